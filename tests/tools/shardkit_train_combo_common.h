// Helpers shared by the shardkit-train combination audits (shardkit_train_combo_test.cc,
// shardkit_train_combo_proc_test.cc, shardkit_train_combo_mpi_test.cc): run the built binary, read the two figures
// its report ends with (final loss, parameter digest), and read a safetensors export back as floats.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/tools/subprocess.h"
#include "tests/tools/train_output.h"

namespace shardkit::combo {

namespace fs = std::filesystem;

inline constexpr double kDeadline = 120;

inline std::string Join(const std::vector<std::string>& args) {
  std::string s;
  for (const std::string& a : args) s += (s.empty() ? "" : " ") + a;
  return s;
}

inline std::vector<std::string> Cat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline testing::RunResult Train(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {SHARDKIT_TRAIN_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  return testing::run_command(argv, kDeadline);
}

// What a finished run reports: its last step's mean loss ("%.9g") and the FNV-1a digest of every parameter.
struct Outcome {
  bool ok = false;
  std::string loss, digest, out, err;
  double loss_value() const { return loss.empty() ? std::nan("") : std::stod(loss); }
};

inline Outcome FromResult(const testing::RunResult& r, const std::string& what) {
  Outcome o;
  o.out = r.out;
  o.err = r.err;
  o.ok = !r.timed_out && r.exit_code == 0;
  EXPECT_TRUE(o.ok) << what << "\nexit " << r.exit_code << (r.timed_out ? " (timed out)" : "") << "\n" << r.err;
  o.loss = testing::Field(r.out, "final loss: ");
  o.digest = testing::Field(r.out, "parameter digest: ");
  // Lines forwarded by shardrun carry a "[rank 0] " prefix before the key; Field reads after the key.
  if (o.ok) {
    EXPECT_EQ(o.digest.size(), 16u) << what << "\n" << r.out;
  }
  return o;
}

// A run that must succeed.
inline Outcome Go(const std::vector<std::string>& args) { return FromResult(Train(args), Join(args)); }

inline std::string TempDir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("shardkit_train_combo_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  return p.string();
}

inline std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// One line "shardkit-train: error: ..." on stderr, exit code 1, in time.
inline void ExpectOneLineError(const testing::RunResult& r, const std::string& needle, const std::string& what = "") {
  EXPECT_FALSE(r.timed_out) << what;
  EXPECT_EQ(r.exit_code, 1) << what << "\n" << r.err << r.out;
  EXPECT_THAT(r.err, ::testing::StartsWith("shardkit-train: error: ")) << what;
  EXPECT_THAT(r.err, ::testing::HasSubstr(needle)) << what;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << what << "\n" << r.err;
  EXPECT_THAT(r.out, ::testing::Not(::testing::HasSubstr("parameter digest"))) << what;
}

// Every F32 tensor of a safetensors file (or of every part of a directory export), by name.
using Tensors = std::map<std::string, std::vector<float>>;

inline void ReadSafetensorsFile(const std::string& path, Tensors& out) {
  const std::string b = ReadBytes(path);
  ASSERT_GE(b.size(), 8u) << path;
  std::uint64_t n = 0;
  std::memcpy(&n, b.data(), 8);
  ASSERT_LE(n, b.size() - 8) << path;
  const nlohmann::json h = nlohmann::json::parse(b.substr(8, n));
  const std::size_t data = 8 + n;
  for (const auto& [name, t] : h.items()) {
    if (name == "__metadata__") continue;
    ASSERT_EQ(t.at("dtype"), "F32") << path << ": " << name;
    const std::uint64_t begin = t.at("data_offsets")[0], end = t.at("data_offsets")[1];
    ASSERT_LE(data + end, b.size()) << path << ": " << name;
    std::vector<float> v((end - begin) / sizeof(float));
    std::memcpy(v.data(), b.data() + data + begin, end - begin);
    ASSERT_EQ(out.count(name), 0u) << "tensor " << name << " twice";
    out[name] = std::move(v);
  }
}

inline Tensors ReadExport(const std::string& path) {
  Tensors out;
  if (fs::is_directory(path)) {
    for (const auto& e : fs::directory_iterator(path)) {
      if (e.path().extension() == ".safetensors") ReadSafetensorsFile(e.path().string(), out);
    }
  } else {
    ReadSafetensorsFile(path, out);
  }
  return out;
}

// The largest |a - b| over every element; +inf when the names or sizes differ.
inline double MaxAbsDiff(const Tensors& a, const Tensors& b) {
  if (a.size() != b.size() || a.empty()) return INFINITY;
  double m = 0;
  for (const auto& [name, v] : a) {
    auto it = b.find(name);
    if (it == b.end() || it->second.size() != v.size()) return INFINITY;
    for (std::size_t i = 0; i < v.size(); ++i) m = std::max(m, std::fabs(double(v[i]) - double(it->second[i])));
  }
  return m;
}

// The JSON lines of a --log file.
inline std::vector<nlohmann::json> ReadLog(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace shardkit::combo
