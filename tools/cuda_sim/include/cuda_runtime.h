// Stand-in for CUDA's cuda_runtime.h for tools/cuda_sim (the simulator in sim.h).
#pragma once
#include "sim.h"
