// All differentiable ops (one include for users of the functional API).
#pragma once

#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/attention.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/embedding.h"
#include "common/autograd/ops/gemm_timing.h"
#include "common/autograd/ops/linalg.h"
#include "common/autograd/ops/loss.h"
#include "common/autograd/ops/norm.h"
#include "common/autograd/ops/reduce.h"
#include "common/autograd/ops/shape.h"
