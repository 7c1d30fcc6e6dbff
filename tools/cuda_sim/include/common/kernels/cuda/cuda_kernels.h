// Stand-in for common/kernels/cuda/cuda_kernels.h for tools/cuda_sim (the kernels need nothing from it).
#pragma once
