#include "tools/shardkit_train/options.h"

#include <charconv>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"

namespace shardkit::train {

std::string backend_label(Backend b, bool processes) {
  if (!processes) return "threads";
  switch (b) {
    case Backend::tcp: return "processes, TCP";
    case Backend::shm: return "processes, shared memory";
    case Backend::mpi: return "processes, MPI";
    case Backend::automatic: break;
  }
  return "processes, shared memory on a host, TCP between hosts";
}

std::string strategy_name(Strategy s) {
  switch (s) {
    case Strategy::ddp: return "ddp";
    case Strategy::oss: return "oss";
    case Strategy::sddp: return "sddp";
    case Strategy::fsdp: return "fsdp";
  }
  return "?";
}

std::vector<Strategy> available_strategies() {
  std::vector<Strategy> out = {Strategy::ddp, Strategy::oss};
#ifdef SHARDKIT_TRAIN_HAS_SDDP
  out.push_back(Strategy::sddp);
#endif
#ifdef SHARDKIT_TRAIN_HAS_FSDP
  out.push_back(Strategy::fsdp);
#endif
  return out;
}

namespace {

// The byte-level sizes shardkit-train started with; the rest come from nn::GPTConfig::named.
absl::StatusOr<nn::GPTConfig> named_config(const std::string& name) {
  nn::GPTConfig c;
  c.vocab_size = 256;
  if (name == "tiny") {
    c.context = 32, c.width = 32, c.num_layers = 2, c.num_heads = 2;
  } else if (name == "small") {
    c.context = 64, c.width = 64, c.num_layers = 2, c.num_heads = 4;
  } else if (name == "base") {
    c.context = 128, c.width = 128, c.num_layers = 4, c.num_heads = 4;
  } else {
    auto named = nn::GPTConfig::named(name);
    if (!named.ok() || named->vocab_size < 256) {
      return absl::InvalidArgumentError(
          absl::StrCat("expected --model ", absl::StrJoin(model_names(), ", "), ", found '", name, "'",
                       named.ok() ? absl::StrCat(" (a vocabulary of ", named->vocab_size, " tokens; bytes need 256)") : ""));
    }
    c = *named;
  }
  return c;
}

}  // namespace

std::vector<std::string> model_names() {
  std::vector<std::string> out = {"tiny", "small", "base"};
  for (const std::string& n : nn::GPTConfig::names()) {
    if (nn::GPTConfig::named(n)->vocab_size >= 256) out.push_back(n);
  }
  return out;
}

absl::StatusOr<ModelSize> model_size(const std::string& name, const ModelShape& shape) {
  auto c = named_config(name);
  if (!c.ok()) return c.status();
  ModelSize m{name, *c};
  auto apply = [&](const std::optional<std::int64_t>& v, std::int64_t& field, const char* flag) {
    if (!v) return;
    field = *v;
    absl::StrAppend(&m.name, " ", flag, " ", *v);
  };
  apply(shape.layers, m.config.num_layers, "--layers");
  apply(shape.width, m.config.width, "--width");
  apply(shape.heads, m.config.num_heads, "--heads");
  apply(shape.context, m.config.context, "--context");
  const nn::GPTConfig& g = m.config;
  if (g.width % g.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("expected --heads to divide the width ", g.width, ", found ", g.num_heads,
                                                   " heads (model ", m.name, ")"));
  }
  return m;
}

namespace {

absl::Status bad(const std::string& flag, const std::string& expected, const std::string& found) {
  return absl::InvalidArgumentError(absl::StrCat("expected ", flag, " ", expected, ", found '", found, "'"));
}

template <typename T>
bool parse_int(const std::string& s, T& out) {
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, out);
  return ec == std::errc() && p == end;
}

}  // namespace

absl::StatusOr<Options> parse_options(const std::vector<std::string>& args) {
  Options o;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i], value;
    bool has_inline = false;
    if (auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1), flag = flag.substr(0, eq), has_inline = true;
    }
    bool consumed = false;  // the inline value was read
    auto next = [&]() -> absl::StatusOr<std::string> {
      consumed = true;
      if (has_inline) return value;
      if (i + 1 >= args.size()) return absl::InvalidArgumentError(absl::StrCat("expected a value after ", flag, ", found none"));
      return args[++i];
    };
    // Range-checked before the conversion to `out`'s type, so no value wraps. `over_max`: the expectation
    // quoted for a value above `max` (default `expected`).
    auto int_flag = [&](auto& out, long long min, const std::string& expected,
                        long long max = std::numeric_limits<long long>::max(),
                        const std::string& over_max = "") -> absl::Status {
      auto v = next();
      if (!v.ok()) return v.status();
      long long x = 0;
      if (!parse_int(*v, x) || x < min) return bad(flag, expected, *v);
      if (x > max) return bad(flag, over_max.empty() ? expected : over_max, *v);
      out = static_cast<std::remove_reference_t<decltype(out)>>(x);
      return absl::OkStatus();
    };
    absl::Status st;
    if (flag == "--help" || flag == "-h") {
      o.help = true;
    } else if (flag == "--strategy") {
      auto v = next();
      if (!v.ok()) return v.status();
      std::string names;
      bool found = false;
      for (Strategy s : available_strategies()) {
        absl::StrAppend(&names, names.empty() ? "" : ", ", strategy_name(s));
        if (*v == strategy_name(s)) o.strategy = s, found = true;
      }
      if (!found) return bad(flag, "one of " + names, *v);
    } else if (flag == "--ranks") {
      st = int_flag(o.ranks, 1, "a number of ranks >= 1", 64, "a number of ranks <= 64");
    } else if (flag == "--model") {
      auto v = next();
      if (!v.ok()) return v.status();
      if (auto m = named_config(*v); !m.ok()) return m.status();
      o.model = *v;
    } else if (flag == "--layers") {
      st = int_flag(o.shape.layers.emplace(), 0, absl::StrCat("a number of layers in [0, ", kMaxLayers, "]"), kMaxLayers);
    } else if (flag == "--width") {
      st = int_flag(o.shape.width.emplace(), 1, absl::StrCat("a width in [1, ", kMaxWidth, "]"), kMaxWidth);
    } else if (flag == "--heads") {
      st = int_flag(o.shape.heads.emplace(), 1, absl::StrCat("a number of heads in [1, ", kMaxWidth, "]"), kMaxWidth);
    } else if (flag == "--context") {
      st = int_flag(o.shape.context.emplace(), 1, absl::StrCat("a context in [1, ", kMaxContext, "] bytes"), kMaxContext);
    } else if (flag == "--log") {
      auto v = next();
      if (!v.ok()) return v.status();
      o.log = *v;
      if (o.log.empty()) return bad(flag, "a file name", "");
    } else if (flag == "--export" || flag == "--init-from") {
      auto v = next();
      if (!v.ok()) return v.status();
      if (v->empty()) return bad(flag, flag == "--export" ? "a .safetensors file or a directory" : "a safetensors file, index or directory", "");
      (flag == "--export" ? o.export_path : o.init_from) = *v;
    } else if (flag == "--steps") {
      st = int_flag(o.steps, 1, "a number of steps >= 1");
    } else if (flag == "--batch") {
      st = int_flag(o.batch, 1, absl::StrCat("a batch size (sequences per rank) in [1, ", kMaxBatch, "]"), kMaxBatch);
    } else if (flag == "--lr") {
      auto v = next();
      if (!v.ok()) return v.status();
      char* end = nullptr;
      o.lr = std::strtod(v->c_str(), &end);
      if (v->empty() || *end != '\0' || !(o.lr > 0) || o.lr > 10) return bad(flag, "a learning rate in (0, 10]", *v);
    } else if (flag == "--precision") {
      auto v = next();
      if (!v.ok()) return v.status();
      if (*v == "fp32") o.precision = Precision::fp32;
      else if (*v == "bf16") o.precision = Precision::bf16;
      else return bad(flag, "fp32 or bf16", *v);
    } else if (flag == "--backend") {
      auto v = next();
      if (!v.ok()) return v.status();
      if (*v == "tcp") o.backend = Backend::tcp;
      else if (*v == "shm") o.backend = Backend::shm;
      else if (*v == "mpi") o.backend = Backend::mpi;
      else return bad(flag, "tcp, shm or mpi", *v);
    } else if (flag == "--seed") {
      st = int_flag(o.seed, 0, "a seed >= 0");
    } else if (flag == "--data") {
      auto v = next();
      if (!v.ok()) return v.status();
      o.data = *v;
      if (o.data.empty()) return bad(flag, "a file name", "");
    } else if (flag == "--checkpoint-dir") {
      auto v = next();
      if (!v.ok()) return v.status();
      o.checkpoint_dir = *v;
      if (o.checkpoint_dir.empty()) return bad(flag, "a directory", "");
    } else if (flag == "--checkpoint-every") {
      st = int_flag(o.checkpoint_every, 1, "a number of steps >= 1");
    } else if (flag == "--resume") {
      o.resume = true;
    } else if (flag == "--overwrite") {
      o.overwrite = true;
    } else if (flag == "--test-checkpoint-consolidated") {
      o.checkpoint_consolidated = true;
    } else if (flag == "--test-kill-checkpoint-write") {
      auto v = next();
      if (!v.ok()) return v.status();
      const std::size_t colon = v->find(':');
      o.kill_checkpoint_file = v->substr(0, colon);
      if (colon == std::string::npos || (o.kill_checkpoint_file != "shard" && o.kill_checkpoint_file != "manifest") ||
          !absl::SimpleAtoi(v->substr(colon + 1), &o.kill_checkpoint_bytes) || o.kill_checkpoint_bytes < 0) {
        return bad(flag, "shard:BYTES or manifest:BYTES", *v);
      }
    } else if (flag == "--compare") {
      o.compare = true;
    } else if (flag == "--checkpoint-activations") {
      o.checkpoint_activations = true;
    } else if (flag == "--compile") {
      o.compile = true;
    } else if (flag == "--svg") {
      auto v = next();
      if (!v.ok()) return v.status();
      o.svg = *v;
    } else if (flag == "--sample") {
      st = int_flag(o.sample_bytes, 0, absl::StrCat("a number of bytes in [0, ", kMaxSampleBytes, "]"), kMaxSampleBytes);
    } else if (flag == "--timeout") {
      auto v = next();
      if (!v.ok()) return v.status();
      double seconds = 0;
      if (!absl::SimpleAtod(*v, &seconds) || !(seconds > 0) || seconds > 86400) {
        return bad(flag, "a number of seconds in (0, 86400]", *v);
      }
      o.timeout = absl::Seconds(seconds);
    } else if (flag == "--stop-after-step") {
      st = int_flag(o.stop_after_step, 1, "a step >= 1");
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown option '", flag, "' (see --help)"));
    }
    if (!st.ok()) return st;
    // A flag that takes no value refuses one: --overwrite=no used to switch --overwrite on (a helper's audit).
    if (has_inline && !consumed) {
      return absl::InvalidArgumentError(absl::StrCat("expected no value after ", flag, " (it takes none), found '=",
                                                     value, "'"));
    }
  }
  if (auto m = model_size(o.model, o.shape); !m.ok()) return m.status();
  if (o.resume && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError("expected --checkpoint-dir with --resume, found none");
  }
  if (o.resume && o.overwrite) {
    return absl::InvalidArgumentError("expected --resume or --overwrite, found both");
  }
  if (o.resume && !o.init_from.empty()) {
    return absl::InvalidArgumentError("expected --init-from or --resume, found both (a checkpoint holds the weights)");
  }
  // Note [--compile] in trainer.cc: what the compiled step covers so far.
  if (o.compile) {
    if (o.strategy != Strategy::ddp && o.strategy != Strategy::fsdp) {
      return absl::InvalidArgumentError(absl::StrCat("--compile: expected --strategy ddp (the replicate mode) or fsdp (the "
                                                     "fully-shard mode), found ", strategy_name(o.strategy)));
    }
    if (o.compare) return absl::InvalidArgumentError("--compile: expected no --compare (it runs every strategy)");
    if (o.precision != Precision::fp32) {
      return absl::InvalidArgumentError("--compile: expected --precision fp32 (bf16 master weights are not captured yet)");
    }
    if (o.strategy == Strategy::fsdp && (!o.checkpoint_dir.empty() || !o.export_path.empty())) {
      return absl::InvalidArgumentError(
          "--compile --strategy fsdp: expected no --checkpoint-dir or --export (the compiled step's shards are not "
          "checkpointed yet)");
    }
  }
  return o;
}

std::string usage() {
  std::string strategies;
  for (Strategy s : available_strategies()) absl::StrAppend(&strategies, strategies.empty() ? "" : "|", strategy_name(s));
  return absl::StrCat(
      "usage: shardkit-train [options]\n"
      "Trains a byte-level GPT on N ranks and shows per-rank memory and communication.\n"
      "  --strategy ", strategies, "   sharding strategy (default oss)\n"
      "  --ranks N               simulated ranks as threads (default 4); under shardrun: one rank per process\n"
      "  --model NAME            model size (default small); bytes are the tokens:\n"
      "                            tiny / small / base: 34,688 / 120,576 / 842,496 parameters (vocab 256,\n"
      "                            2 layers width 32 / 2 layers width 64 / 4 layers width 128)\n"
      "                            gpt-1m / gpt-10m / gpt-100m: the benchmarks' sizes (867,072 / 10,558,976 / 98,032,128)\n"
      "                            gpt2-small: GPT-2 small's shape, 124,439,808 parameters (context 1024)\n"
      "  --layers N --width N --heads N --context N\n"
      "                          replace that part of --model's shape (heads must divide the width)\n"
      "  --steps N               optimizer steps (default 300)\n"
      "  --batch N               sequences per rank per step (default 4, at most ", kMaxBatch, ")\n"
      "  --lr X                  peak learning rate, warmup + cosine (default 3e-3)\n"
      "  --precision fp32|bf16   bf16: mixed precision for every strategy: forward and backward on the parameters'\n"
      "                          values rounded to bf16 (f32 arithmetic on CPU), gradients reduced in bf16 (fsdp:\n"
      "                          all-gathers too), f32 master parameters and AdamW state (default fp32)\n"
      "  --backend tcp|shm|mpi   process ranks only (shardrun, or mpirun / srun with the store at MASTER_ADDR): by\n"
      "                          default shared memory between ranks on one host and TCP between hosts; tcp or shm\n"
      "                          for every pair; mpi under mpirun (mpirun -np 4 shardkit-train --backend mpi)\n"
      "  --seed N                model init and data order (default 1)\n"
      "  --data FILE             train on FILE's bytes instead of the embedded corpus (a regular file of at most\n"
      "                          1 GiB: it is read whole)\n"
      "  --checkpoint-dir DIR    write a sharded checkpoint to DIR every --checkpoint-every steps (default 50) and\n"
      "                          at the end: one file per rank and DIR/manifest.json; a DIR that already holds a\n"
      "                          checkpoint is refused without --resume or --overwrite; one run per DIR (a lock)\n"
      "  --resume                continue from DIR's checkpoint (written at any --ranks, by any --strategy)\n"
      "  --overwrite             replace the checkpoint DIR holds (of another run) instead of refusing\n"
      "  --compare               run every strategy on the same model and data; table + SVG (--svg FILE)\n"
      "  --compile               capture the training step once and replay it (ddp: the replicate mode, fsdp: the\n"
      "                          fully-shard mode; fp32); the report shows the step's graph\n"
      "  --checkpoint-activations\n"
      "                          recompute each transformer block's activations in backward instead of keeping\n"
      "                          them (same results, less activation memory); the report shows the activation\n"
      "                          peak with and without\n"
      "  --log FILE.jsonl        one JSON object per step: step, loss, lr, tokens/s, seconds, memory by category\n"
      "  --export FILE.safetensors\n"
      "                          after the last step, the weights with GPT-2's names in one file (rank 0); a path\n"
      "                          without that suffix is a directory of Hugging Face parts, one per rank, and\n"
      "                          model.safetensors.index.json (fsdp: written shard by shard, never gathered)\n"
      "  --init-from FILE        start from GPT-2 weights (.safetensors, index .json or a directory) of the\n"
      "                          --model / shape flags' shape instead of the seed's initial values\n"
      "  --sample N              bytes of generated text to print at the end (default 160, at most ", kMaxSampleBytes, ")\n"
      "  --timeout S             every collective's deadline in seconds (default 120 for threads, 300 for processes;\n"
      "                          over SHARDKIT_TIMEOUT); a stopped process rank is named sooner by the heartbeat\n"
      "                          watchdog (SHARDKIT_HEARTBEAT_WINDOW, default 10 s)\n");
}

}  // namespace shardkit::train
