// Everything in common/nn (one include).
#pragma once

#include "common/nn/checkpoint.h"
#include "common/nn/deferred_init.h"
#include "common/nn/gpt.h"
#include "common/nn/layers.h"
#include "common/nn/models.h"
#include "common/nn/module.h"
#include "common/nn/transformer.h"
