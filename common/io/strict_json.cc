#include "common/io/strict_json.h"

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace shardkit::io {
namespace {

// A SAX handler that builds nothing: it keeps, per open container, the keys seen so far (objects) and the
// key under which that container sits, to name the place of an error.
class StrictSax {
 public:
  using json = nlohmann::json;
  explicit StrictSax(int max_depth) : max_depth_(max_depth) {}

  bool null() { return value(); }
  bool boolean(bool) { return value(); }
  bool number_integer(json::number_integer_t) { return value(); }
  bool number_unsigned(json::number_unsigned_t) { return value(); }
  bool number_float(json::number_float_t, const json::string_t&) { return value(); }
  bool string(json::string_t&) { return value(); }
  bool binary(json::binary_t&) { return value(); }
  bool start_object(std::size_t) { return open(true); }
  bool start_array(std::size_t) { return open(false); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    Frame& f = frames_.back();
    if (!f.keys.insert(k).second) {
      error_ = absl::StrCat("duplicate key \"", k, "\" ", where(frames_.size() - 1));
      return false;
    }
    f.current_key = k;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) {
    error_ = absl::StrCat("not valid JSON: ", ex.what());
    return false;
  }

  const std::string& error() const { return error_; }

 private:
  struct Frame {
    bool is_object = false;
    std::set<std::string> keys;
    std::string current_key;  // objects: the key whose value is being read
    std::size_t index = 0;    // arrays: the element being read
  };

  bool value() {
    if (!frames_.empty() && !frames_.back().is_object) ++frames_.back().index;
    return true;
  }
  bool open(bool is_object) {
    if (static_cast<int>(frames_.size()) > max_depth_) {
      error_ = absl::StrCat("expected nesting at most ", max_depth_, " deep, found deeper ", where(frames_.size()));
      return false;
    }
    frames_.emplace_back();
    frames_.back().is_object = is_object;
    return true;
  }
  bool close() {
    frames_.pop_back();
    return value();
  }
  // The place below the first `depth` open containers: "at the top level" or "in \"a\".\"shape\"[2]".
  std::string where(std::size_t depth) const {
    std::string path;
    for (std::size_t i = 0; i < depth; ++i) {
      const Frame& f = frames_[i];
      if (f.is_object) {
        absl::StrAppend(&path, path.empty() ? "" : ".", "\"", f.current_key, "\"");
      } else {
        absl::StrAppend(&path, "[", f.index, "]");
      }
    }
    return path.empty() ? "at the top level" : absl::StrCat("in ", path);
  }

  int max_depth_;
  std::vector<Frame> frames_;
  std::string error_;
};

}  // namespace

absl::Status check_json_strict(std::string_view text, std::string_view what, int max_depth) {
  StrictSax sax(max_depth);
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(text.begin(), text.end(), &sax);
  } catch (const nlohmann::json::exception& e) {  // sax_parse reports through parse_error; belt and braces
    return absl::DataLossError(absl::StrCat(std::string(what), ": not valid JSON: ", e.what()));
  }
  if (!ok) {
    return absl::DataLossError(
        absl::StrCat(std::string(what), ": ", sax.error().empty() ? std::string("not valid JSON") : sax.error()));
  }
  return absl::OkStatus();
}

}  // namespace shardkit::io
