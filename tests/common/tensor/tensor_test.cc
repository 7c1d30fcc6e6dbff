#include "common/tensor/device_memory.h"
#include "common/tensor/rank_context.h"
#include "common/tensor/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(TensorTest, CreationAndMetadata) {
  Tensor t = Tensor::full({2, 3}, 1.5);
  EXPECT_EQ(t.numel(), 6);
  EXPECT_EQ(t.dim(), 2);
  EXPECT_EQ(t.size(-1), 3);
  EXPECT_EQ(t.nbytes(), 24u);
  EXPECT_EQ(t.describe(), "f32[2, 3] cpu");
  EXPECT_THAT(t.to_vector(), ElementsAre(1.5, 1.5, 1.5, 1.5, 1.5, 1.5));
  Tensor e = Tensor::empty({0, 4});
  EXPECT_EQ(e.numel(), 0);
  EXPECT_EQ(e.to_vector().size(), 0u);
}

TEST(TensorTest, HandlesShareGradAndFlags) {
  Tensor a = Tensor::zeros({4});
  Tensor b = a;
  b.set_requires_grad(true);
  EXPECT_TRUE(a.requires_grad());
  a.set_grad(Tensor::full({4}, 2.0));
  EXPECT_TRUE(b.grad().defined());
  EXPECT_EQ(b.grad().item_at(3), 2.0);
  EXPECT_TRUE(a.is_same(b));
  EXPECT_FALSE(a.is_same(a.detach()));
}

TEST(TensorTest, ViewsShareStorage) {
  Tensor flat = Tensor::from_vector({0, 1, 2, 3, 4, 5, 6, 7}, {8});
  Tensor tail = flat.view(4, {2, 2});
  tail.fill_(9);
  EXPECT_THAT(flat.to_vector(), ElementsAre(0, 1, 2, 3, 9, 9, 9, 9));
  Tensor m = flat.reshape({2, -1});
  EXPECT_EQ(m.shape(), (Shape{2, 4}));
  EXPECT_EQ(m.narrow0(1, 1).to_vector()[0], 9);
  EXPECT_THROW(flat.view(6, {4}), InternalError);
  EXPECT_THROW(flat.reshape({3, -1}), InternalError);
}

TEST(TensorTest, CopyConvertsDtypes) {
  Tensor f = Tensor::from_vector({1.0f, -2.5f, 3.00390625f, 65536.0f}, {4});
  Tensor h = f.to(DType::f16);
  Tensor b = f.to(DType::bf16);
  EXPECT_EQ(h.nbytes(), 8u);
  EXPECT_THAT(h.to_vector(), ElementsAre(1.0f, -2.5f, 3.00390625f, std::numeric_limits<float>::infinity()));
  EXPECT_THAT(b.to_vector(), ElementsAre(1.0f, -2.5f, 3.0f, 65536.0f));  // 3.0039 ties to even 3.0 in bf16
  Tensor i = Tensor::from_int64({1, -2, 3}, {3});
  EXPECT_THAT(i.to(DType::f32).to_vector(), ElementsAre(1, -2, 3));
  Tensor back = Tensor::empty({4});
  back.copy_(h);
  EXPECT_EQ(back.item_at(1), -2.5);
}

TEST(TensorTest, ReleaseAndRebind) {
  Tensor p = Tensor::from_vector({1, 2, 3, 4}, {2, 2});
  Tensor full = Tensor::from_vector({5, 6, 7, 8, 9, 10}, {6});
  Tensor handle = p;
  p.release_storage();
  EXPECT_TRUE(p.storage_released());
  try {
    p.to_vector();
    FAIL() << "expected an error";
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), HasSubstr("released"));
  }
  p.rebind(full.view(2, {2, 2}));
  EXPECT_THAT(handle.to_vector(), ElementsAre(7, 8, 9, 10));
  full.fill_(0);
  EXPECT_THAT(handle.to_vector(), ElementsAre(0, 0, 0, 0));
  EXPECT_THROW(p.rebind(full.view(0, {4})), InternalError);
}

TEST(TensorTest, CheckMessagesNameBothOperands) {
  Tensor a = Tensor::zeros({3});
  try {
    a.copy_(Tensor::zeros({4}));
    FAIL();
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), HasSubstr("tensor.cc"));
    EXPECT_THAT(e.what(), HasSubstr("(3 vs 4)"));
    EXPECT_THAT(e.what(), HasSubstr("f32[4] cpu"));
  }
}

TEST(TensorTest, RequiresGradOnlyForFloatingTypes) {
  EXPECT_THROW(Tensor::from_int64({1}, {1}).set_requires_grad(true), InternalError);
}

TEST(TensorTest, CudaAllocationWithoutADeviceFailsClearly) {
  if (detail::cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  RankContext ctx;
  RankContextScope scope(ctx);
  TensorOptions o;
  o.device = Device::cuda(0);
  try {
    Tensor::empty({4}, o);
    FAIL();
  } catch (const InternalError& e) {
#ifdef SHARDKIT_HAS_CUDA
    EXPECT_THAT(e.what(), HasSubstr("cuda:0"));
#else
    EXPECT_THAT(e.what(), HasSubstr("built without CUDA"));
#endif
  }
  EXPECT_EQ(ctx.memory->total_current(), 0);  // nothing charged for a failed allocation
}

// Shapes from outside (a checkpoint file, another rank) go through checked_numel: negative dimensions and
// element or byte counts past int64 are an error naming the shape, never a wrapped count.
TEST(ShapeNumelTest, CheckedNumelRefusesNegativeDimsAndOverflow) {
  constexpr std::int64_t k32 = std::int64_t{1} << 32, k31 = std::int64_t{1} << 31;
  EXPECT_EQ(*checked_numel({2, 3}, DType::f32), 6);
  EXPECT_EQ(*checked_numel({}, DType::f32), 1);
  EXPECT_EQ(*checked_numel({k32, k32, 0}, DType::f32), 0);  // a zero dimension: no elements, no overflow
  EXPECT_EQ(*checked_numel({k31, k31 / 2}, DType::bf16), k31 * (k31 / 2));  // 2^62 bytes

  auto neg = checked_numel({2, -1}, DType::f32);
  EXPECT_EQ(neg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(neg.status().message(), HasSubstr("expected dimensions >= 0, found -1 in shape [2, -1]"));

  auto elems = checked_numel({k32, k32}, DType::f32);
  EXPECT_EQ(elems.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(elems.status().message(),
              HasSubstr("expected at most 9223372036854775807 elements, found shape [4294967296, 4294967296]"));

  // 2^62 elements fit in int64; 2^62 x 4 bytes of f32 do not.
  auto bytes = checked_numel({k31, k31}, DType::f32);
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bytes.status().message(),
              HasSubstr("expected at most 9223372036854775807 bytes, found shape [2147483648, 2147483648] of f32"));
}

// Inside the library an overflowing shape is a broken invariant: a check, never a wrapped count (before the
// fix shape_numel({2^32, 2^32}) returned 0 and Tensor::empty made an empty tensor of that shape).
TEST(ShapeNumelTest, ShapeNumelAndCreationCheckOverflow) {
  constexpr std::int64_t k32 = std::int64_t{1} << 32;
  EXPECT_EQ(shape_numel({2, 3, 4}), 24);
  EXPECT_EQ(shape_numel({k32, k32, 0}), 0);
  EXPECT_THROW(shape_numel({k32, k32}), InternalError);
  EXPECT_THROW(shape_numel({3, -2}), InternalError);
  EXPECT_THROW(Tensor::empty({k32, k32}), InternalError);
  EXPECT_THROW(Tensor::empty({std::int64_t{1} << 62}, TensorOptions{}.with_dtype(DType::i64)), InternalError);
  Tensor t = Tensor::zeros({8});
  EXPECT_THROW(t.reshape({k32, k32, 0, -1}), InternalError);
  EXPECT_THROW(t.reshape({-2, -4}), InternalError);
}

}  // namespace
}  // namespace shardkit
