// Internal-invariant checks (DESIGN.md section 7).
//
// SK_CHECK(cond) << "context";          SK_CHECK_EQ(a, b) << "context";   (also NE, LT, LE, GT, GE)
//
// A failed check throws shardkit::InternalError whose message names the file, the line, the condition
// and, for the comparison forms, both operand values (gloo's ENFORCE style). Checks are for broken
// invariants inside the library; errors caused by input, the environment or another rank are returned
// as absl::Status instead. Throwing (rather than aborting) lets the simulated-rank harness report the
// failing rank and release the others.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace shardkit {

class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {

// Collects the streamed context and throws from its destructor's caller (see SK_CHECK).
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const std::string& what);
  [[noreturn]] ~CheckFailure() noexcept(false);
  template <typename T>
  CheckFailure& operator<<(const T& v) {
    extra_ << v;
    return *this;
  }

 private:
  std::string head_;
  std::ostringstream extra_;
};

// Empty when `pass`; otherwise the expression with both operand values.
template <typename A, typename B>
std::string CompareMessage(bool pass, const char* expr, const A& a, const B& b) {
  if (pass) return {};
  std::ostringstream os;
  os << expr << " (" << a << " vs " << b << ")";
  return os.str();
}

}  // namespace detail
}  // namespace shardkit

#define SK_CHECK(cond) \
  if (cond) {          \
  } else               \
    ::shardkit::detail::CheckFailure(__FILE__, __LINE__, "check failed: " #cond)

#define SK_CHECK_OP_(a, b, op)                                                                   \
  if (std::string sk_msg_ = [](const auto& sk_a_, const auto& sk_b_) {                           \
        return ::shardkit::detail::CompareMessage(sk_a_ op sk_b_, "check failed: " #a " " #op " " #b, \
                                                  sk_a_, sk_b_);                                 \
      }((a), (b));                                                                               \
      sk_msg_.empty()) {                                                                         \
  } else                                                                                         \
    ::shardkit::detail::CheckFailure(__FILE__, __LINE__, sk_msg_)

#define SK_CHECK_EQ(a, b) SK_CHECK_OP_(a, b, ==)
#define SK_CHECK_NE(a, b) SK_CHECK_OP_(a, b, !=)
#define SK_CHECK_LT(a, b) SK_CHECK_OP_(a, b, <)
#define SK_CHECK_LE(a, b) SK_CHECK_OP_(a, b, <=)
#define SK_CHECK_GT(a, b) SK_CHECK_OP_(a, b, >)
#define SK_CHECK_GE(a, b) SK_CHECK_OP_(a, b, >=)
