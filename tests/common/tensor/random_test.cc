#include <cmath>
#include <thread>
#include <vector>

#include "common/tensor/random.h"
#include "gtest/gtest.h"

namespace shardkit {
namespace {

TEST(RandomTest, PhiloxKnownAnswer) {
  // Known-answer vectors from the Random123 distribution (philox4x32, 10 rounds).
  auto r0 = philox4x32({0, 0, 0, 0}, 0);
  EXPECT_EQ(r0[0], 0x6627e8d5u);
  EXPECT_EQ(r0[1], 0xe169c58du);
  EXPECT_EQ(r0[2], 0xbc57ac4cu);
  EXPECT_EQ(r0[3], 0x9b00dbd8u);
  auto r1 = philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffffffffffull);
  EXPECT_EQ(r1[0], 0x408f276du);
  EXPECT_EQ(r1[1], 0x41c83b0eu);
  EXPECT_EQ(r1[2], 0xa20bc7c6u);
  EXPECT_EQ(r1[3], 0x6d5451fdu);
}

TEST(RandomTest, DeterministicRegardlessOfThreads) {
  auto draw = [](std::uint64_t stream) {
    Generator g(42, stream);
    std::vector<float> v(1001);
    g.fill_normal(v.data(), 1001);
    return v;
  };
  std::vector<float> a, b;
  std::thread t1([&] { a = draw(3); });
  std::thread t2([&] { b = draw(3); });
  t1.join();
  t2.join();
  EXPECT_EQ(a, b);
  EXPECT_NE(draw(3), draw(4));
}

TEST(RandomTest, SplitDrawsEqualOneDraw) {
  Generator a(7), b(7);
  std::vector<float> whole(16), parts(16);
  a.fill_uniform(whole.data(), 16);
  b.fill_uniform(parts.data(), 8);
  b.fill_uniform(parts.data() + 8, 8);
  EXPECT_EQ(whole, parts);
  EXPECT_EQ(a.offset(), 4u);
}

TEST(RandomTest, MomentsAreRight) {
  Generator g(1);
  const int n = 200000;
  std::vector<float> u(n), z(n);
  g.fill_uniform(u.data(), n, -1.f, 3.f);
  g.fill_normal(z.data(), n, 2.f, 0.5f);
  double su = 0, sz = 0, sz2 = 0;
  for (int i = 0; i < n; ++i) {
    ASSERT_GE(u[i], -1.f);
    ASSERT_LT(u[i], 3.f);
    su += u[i];
    sz += z[i];
    sz2 += (z[i] - 2.0) * (z[i] - 2.0);
  }
  EXPECT_NEAR(su / n, 1.0, 0.01);
  EXPECT_NEAR(sz / n, 2.0, 0.005);
  EXPECT_NEAR(std::sqrt(sz2 / n), 0.5, 0.005);
}

}  // namespace
}  // namespace shardkit
