// All differentiable ops (one include for users of the functional API).
#pragma once

#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/reduce.h"
#include "common/autograd/ops/shape.h"
