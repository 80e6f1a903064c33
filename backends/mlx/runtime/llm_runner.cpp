// emlx_runner: runs a .pte made by `executorch-mlx export` from C++, token
// ids in, token ids out, with the sampler on the device.
//
//   emlx_runner MODEL.pte --prompt-ids 1,2,3 [--max-new-tokens N] [--seed S]
//               [--temperature T] [a flag per row parameter of the sampler table,
//               e.g. --top-k K] [--repetition-context-size N] [--logit-bias ID=VALUE]...
//               [--memory-budget-kib N] [--data MODEL.ptd]
//               [--prompt-lookup | --draft-model DRAFT.pte] [--num-draft-tokens K] [--fixed-draft-length]
//
// Prints the generated ids on one line ("ids: ..."), then prefill and decode
// tokens per second (and, drafting, how many drafts were accepted). It is
// the example a C++ app copies: load the program (memory-mapped), read its
// metadata (constant methods), find the inputs by name, prefill in chunks,
// decode one token per call, or verify drafts in one call (speculative
// decoding, llm/export/speculative.py: the ids are plain decoding's). It mirrors the Python
// LLMRunner (backends/mlx/llm/run/runner.py) exactly, so both give the same ids;
// both read the program contract (generated/program_contract.h) and the
// sampler table (generated/sampler_params.h) generated from one source.

#include <executorch/extension/tensor/tensor_ptr.h>
#include <executorch/runtime/backend/backend_options_map.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/runtime.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "generated/program_contract.h"
#include "generated/sampler_params.h"
#include "program_files.h"

extern "C" int emlx_registered();  // our plugin: linking it registers the backend
extern "C" const char* emlx_backend_id();

namespace {

namespace et = executorch::runtime;
using executorch::aten::ScalarType;
using executorch::extension::make_tensor_ptr;
using executorch::extension::TensorPtr;
using Sizes = std::vector<executorch::aten::SizesType>;
using emlx::kSamplerInputs;
using emlx::kNumSamplerInputs;
namespace contract = emlx::contract;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using emlx::files::check;
using emlx::files::LoadedMethod;

// The program's metadata: ExecuTorch's LLM-runner names plus ours.
struct Metadata {
  std::vector<std::string> input_names;
  bool samples = false;
  int64_t max_context = 0, max_chunk = 0, vocab_size = 0, bos_id = -1;
  int64_t max_draft_tokens = 0;  // drafts one call verifies (0: none, or a program from before)
  int64_t max_batch = 1;  // rows a call takes (export --max-batch); this runner runs row 0
  std::set<int64_t> eos_ids;
  std::string weights_file;  // the .ptd holding its weights (export --external-weights), or ""
};

Metadata read_metadata(et::Program& program) {
  std::map<std::string, std::vector<et::EValue>> values;
  std::vector<std::unique_ptr<LoadedMethod>> keep;  // EValues may point into their method
  for (size_t i = 0; i < program.num_methods(); ++i) {
    const std::string name = program.get_method_name(i).get();
    if (name == "forward") continue;
    keep.push_back(std::make_unique<LoadedMethod>(program, name.c_str()));
    keep.back()->execute();
    auto& m = *keep.back()->method;
    for (size_t o = 0; o < m.outputs_size(); ++o) values[name].push_back(m.get_output(o));
  }
  auto one = [&](const char* name) -> const et::EValue& {
    auto it = values.find(name);
    if (it == values.end() || it->second.size() != 1) {
      throw std::runtime_error(std::string("this .pte has no '") + name +
                               "' metadata: export it with executorch-mlx export");
    }
    return it->second[0];
  };
  // EValue's to*() abort on another type: each is checked first.
  auto wrong = [](const char* name, const char* type) {
    return std::runtime_error(std::string("this .pte's '") + name + "' metadata is not " + type +
                              ": export it with executorch-mlx export");
  };
  auto integer = [&](const char* name) {
    const auto& v = one(name);
    if (!v.isInt()) throw wrong(name, "an int");
    return v.toInt();
  };
  Metadata md;
  if (!one(contract::kInputNames).isString()) throw wrong(contract::kInputNames, "a string");
  std::stringstream names(std::string(one(contract::kInputNames).toString()));
  for (std::string n; std::getline(names, n, ',');) md.input_names.push_back(n);
  if (!one(contract::kSamples).isBool()) throw wrong(contract::kSamples, "a bool");
  md.samples = one(contract::kSamples).toBool();
  md.max_context = integer(contract::kMaxContextLen);
  md.max_chunk = integer(contract::kMaxSeqLen);
  md.vocab_size = integer(contract::kVocabSize);
  for (const auto& e : values[contract::kEosIds]) {
    if (!e.isInt()) throw wrong(contract::kEosIds, "a list of ints");
    md.eos_ids.insert(e.toInt());
  }
  if (values.count(contract::kBosId)) md.bos_id = integer(contract::kBosId);
  if (values.count(contract::kMaxDraftTokens)) md.max_draft_tokens = integer(contract::kMaxDraftTokens);
  if (values.count(contract::kMaxBatch)) md.max_batch = integer(contract::kMaxBatch);
  if (md.max_batch < 1) throw wrong(contract::kMaxBatch, "at least 1");
  if (values.count(contract::kWeightsFile)) {
    if (!one(contract::kWeightsFile).isString()) throw wrong(contract::kWeightsFile, "a string");
    md.weights_file = std::string(one(contract::kWeightsFile).toString());
  }
  if (md.max_draft_tokens < 0 || md.max_draft_tokens >= md.max_context) {
    throw wrong(contract::kMaxDraftTokens, "in [0, max context)");
  }
  if (md.max_context < 2 || md.max_chunk < 1 || md.vocab_size < 1 || md.input_names.size() < 2 ||
      md.input_names[0] != contract::kInputIds || md.input_names[1] != contract::kCachePosition) {
    throw std::runtime_error("this .pte's metadata is not an LLM program's: export it with executorch-mlx export");
  }
  return md;
}

// The sampler inputs that have a flag: temperature and the row parameters.
bool has_flag(int i) { return kSamplerInputs[i].cli != nullptr; }

struct Options {
  std::string pte;
  std::vector<int64_t> prompt;
  int64_t max_new_tokens = 32;
  int64_t seed = 0;
  // The sampler table's flags, by index into kSamplerInputs; each starts off
  // (the Python runner's names and defaults). Integers are kept whole.
  std::array<double, kNumSamplerInputs> value{};
  std::array<int64_t, kNumSamplerInputs> integer{};
  int64_t repetition_context_size = 20;
  std::vector<std::pair<int64_t, float>> logit_bias;
  int64_t memory_budget_kib = 0;  // 0: the plugin's default (EMLX_MEMORY_BUDGET or a quarter of memory)
  std::string data;  // the program's weights file; "": the one its metadata names, beside it
  // Speculative decoding (the Python runner's names and defaults).
  bool prompt_lookup = false;
  std::string draft_model;
  int64_t num_draft_tokens = 0;  // 0: the program's max_draft_tokens
  bool fixed_draft_length = false;

  Options() {
    for (int i = 0; i < kNumSamplerInputs; ++i) {
      value[i] = kSamplerInputs[i].off, integer[i] = static_cast<int64_t>(has_flag(i) ? kSamplerInputs[i].off : 0);
    }
  }
  bool on(int i) const { return has_flag(i) && value[i] != kSamplerInputs[i].off; }
  // A parameter that counts tokens of the history is on.
  bool penalized() const {
    for (int i = 0; i < kNumSamplerInputs; ++i) {
      if (on(i) && kSamplerInputs[i].needs >= 0 && std::string(kSamplerInputs[kSamplerInputs[i].needs].name) == "history") {
        return true;
      }
    }
    return false;
  }
  bool any_on() const {
    for (int i = 0; i < kNumSamplerInputs; ++i) {
      if (on(i)) return true;
    }
    return !logit_bias.empty();
  }
};

float parse_float(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const float v = std::strtof(text.c_str(), &end);
  if (text.empty() || *end != '\0') throw UsageError(flag + ": expected a number, got '" + text + "'");
  // "1e40" is not infinity: say so rather than use inf (write inf for that)
  if (errno == ERANGE && std::isinf(v)) throw UsageError(flag + ": " + text + " does not fit in float32");
  return v;
}

int64_t parse_int(const std::string& flag, const std::string& text) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) throw UsageError(flag + ": expected an integer, got '" + text + "'");
  return v;
}

// The index in kSamplerInputs of the input whose flag is `flag`, or -1.
int flag_index(const std::string& flag) {
  for (int i = 0; i < kNumSamplerInputs; ++i) {
    if (has_flag(i) && flag == kSamplerInputs[i].cli) return i;
  }
  return -1;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    // --flag=VALUE as well as --flag VALUE (as Python's argparse)
    std::optional<std::string> inline_value;
    if (const size_t eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = a.substr(eq + 1);
      a.resize(eq);
    }
    auto value = [&]() -> std::string {
      if (inline_value) return *std::exchange(inline_value, std::nullopt);
      if (i + 1 >= argc) throw UsageError(a + " needs a value");
      return argv[++i];
    };
    if (a == "--prompt-ids") {
      std::string list = value();
      for (char& c : list) c = (c == ',') ? ' ' : c;
      std::stringstream ss(list);
      for (std::string t; ss >> t;) o.prompt.push_back(parse_int(a, t));
    } else if (a == "--max-new-tokens") {
      o.max_new_tokens = parse_int(a, value());
    } else if (const int k = flag_index(a); k >= 0) {
      const auto& p = kSamplerInputs[k];
      const std::string text = value();
      if (p.integer) {
        o.integer[k] = parse_int(a, text), o.value[k] = static_cast<double>(o.integer[k]);
      } else {
        o.value[k] = parse_float(a, text);
      }
      if (!emlx::accepts(p, o.value[k])) throw UsageError(a + " must be " + p.expect);
    } else if (a == "--repetition-context-size") {
      o.repetition_context_size = parse_int(a, value());
      if (o.repetition_context_size < 1) throw UsageError("--repetition-context-size must be positive");
    } else if (a == "--logit-bias") {
      const std::string t = value();
      const size_t eq = t.find('=');
      if (eq == std::string::npos) throw UsageError("--logit-bias: expected ID=VALUE, got '" + t + "'");
      const float v = parse_float(a, t.substr(eq + 1));
      if (std::isnan(v)) throw UsageError("--logit-bias: the value must not be NaN");
      o.logit_bias.emplace_back(parse_int(a, t.substr(0, eq)), v);
    } else if (a == "--memory-budget-kib") {
      o.memory_budget_kib = parse_int(a, value());
      if (o.memory_budget_kib < 1 || o.memory_budget_kib > INT32_MAX) {
        throw UsageError("--memory-budget-kib must be in [1, 2^31)");
      }
    } else if (a == "--prompt-lookup") {
      o.prompt_lookup = true;
    } else if (a == "--data") {
      o.data = value();
      if (o.data.empty()) throw UsageError("--data needs a file");
    } else if (a == "--draft-model") {
      o.draft_model = value();
    } else if (a == "--num-draft-tokens") {
      o.num_draft_tokens = parse_int(a, value());
      if (o.num_draft_tokens < 1) throw UsageError("--num-draft-tokens must be positive");
    } else if (a == "--fixed-draft-length") {
      o.fixed_draft_length = true;
    } else if (a == "--seed") {
      // any 64-bit seed, signed or not (as the Python runner: 2**63 and up keep their bits)
      const std::string t = value();
      size_t used = 0;
      try {
        o.seed = t.rfind('-', 0) == 0 ? std::stoll(t, &used) : static_cast<int64_t>(std::stoull(t, &used));
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != t.size()) throw UsageError("--seed: expected a 64-bit integer, got '" + t + "'");
    } else if (a.rfind("--", 0) == 0) {
      throw UsageError("unknown option " + a);
    } else if (o.pte.empty()) {
      o.pte = a;
    } else {
      throw UsageError("one .pte only (got '" + o.pte + "' and '" + a + "')");
    }
  }
  if (o.pte.empty()) throw UsageError("no .pte given");
  if (o.prompt.empty()) throw UsageError("--prompt-ids is required (comma-separated token ids)");
  if (o.prompt_lookup && !o.draft_model.empty()) {
    throw UsageError("--draft-model and --prompt-lookup are two drafters: give one");
  }
  if (o.num_draft_tokens && !o.prompt_lookup && o.draft_model.empty()) {
    throw UsageError("--num-draft-tokens needs a drafter (--draft-model or --prompt-lookup)");
  }
  if (o.max_new_tokens < 1) throw UsageError("--max-new-tokens must be positive");
  return o;
}

// One call of `forward`: ids at positions start, start+1, ...; returns the
// next token. Inputs are found by name; a sampler parameter that is not off
// must be an input of the program.
class Generator {
 public:
  Generator(LoadedMethod& forward, const Metadata& md, const Options& o)
      : forward_(forward), md_(md), context_size_(o.repetition_context_size), penalized_(o.penalized()) {
    auto meta = forward.method->method_meta();
    auto shape = [&](const std::string& name) -> Sizes {
      for (size_t i = 0; i < md.input_names.size(); ++i) {
        if (md.input_names[i] != name) continue;
        auto info = meta.input_tensor_meta(i);
        check(info.error(), "reading input '" + name + "'");
        Sizes sizes(info->sizes().begin(), info->sizes().end());
        if (sizes.size() != 2) {  // the names asked for here are [batch, slots]
          throw std::runtime_error("this .pte's input '" + name + "' is not [batch, size]: export it with "
                                   "executorch-mlx export");
        }
        if (md.max_batch > 1) sizes[0] = 1;  // (reported as the most rows a call takes; this runner runs one)
        return sizes;
      }
      return {};
    };
    auto has = [&](const std::string& name) {
      return std::find(md.input_names.begin(), md.input_names.end(), name) != md.input_names.end();
    };
    auto need = [&](const char* name, bool on) {
      if (on && !has(name)) throw UsageError(std::string("this program was exported without ") + name);
    };
    // one value, or a batched program's one row of values
    const Sizes one = md.max_batch > 1 ? Sizes{1} : Sizes{};
    for (int i = 0; i < kNumSamplerInputs; ++i) {
      if (!has_flag(i)) continue;
      const auto& p = kSamplerInputs[i];
      need(p.name, p.kind == 'r' && o.on(i));
      inputs_[p.name] = p.integer ? make_tensor_ptr(one, std::vector<int64_t>{o.integer[i]})
                                  : make_tensor_ptr(one, std::vector<float>{static_cast<float>(o.value[i])});
    }
    need("logit_bias_ids", !o.logit_bias.empty());
    inputs_["seed"] = make_tensor_ptr(one, std::vector<int64_t>{o.seed});
    inputs_["position"] = make_tensor_ptr(one, std::vector<int64_t>{0});
    batched_ = md.max_batch > 1;
    if (has("history")) {
      const Sizes h = shape("history");
      if (penalized_ && context_size_ > h.at(1)) {
        throw UsageError("--repetition-context-size " + std::to_string(context_size_) + " exceeds this program's history of " +
                         std::to_string(h.at(1)) + " tokens");
      }
      // Built per call (step): a program that verifies drafts samples as many
      // rows as its history has; its reported size is the most it takes.
      history_size_ = h.at(1);
    }
    if (has("logit_bias_ids")) {
      const Sizes b = shape("logit_bias_ids");
      if (static_cast<int64_t>(o.logit_bias.size()) > b.at(1)) {
        throw UsageError("--logit-bias: this program takes at most " + std::to_string(b.at(1)) + " entries");
      }
      std::vector<int64_t> ids(b.at(0) * b.at(1), -1);
      std::vector<float> values(ids.size(), 0.0f);
      for (size_t j = 0; j < o.logit_bias.size(); ++j) {
        if (o.logit_bias[j].first < 0 || o.logit_bias[j].first >= md.vocab_size) {
          throw UsageError("--logit-bias: token ids must be in [0, " + std::to_string(md.vocab_size) + ")");
        }
        ids[j] = o.logit_bias[j].first, values[j] = o.logit_bias[j].second;
      }
      inputs_["logit_bias_ids"] = make_tensor_ptr(b, std::move(ids));
      inputs_["logit_bias_values"] = make_tensor_ptr(b, std::move(values));
    }
    if (has("token_bitmask")) {  // every bit set: no grammar constrains this runner's output
      const Sizes m = shape("token_bitmask");
      inputs_["token_bitmask"] = make_tensor_ptr(m, std::vector<int32_t>(m.at(0) * m.at(1), -1));
    }
  }

  // `ids` at positions start, start + 1, ...: their last `drafts.size()`
  // are drafts to verify. `context`: prompt and output so far (the
  // penalties count its tail), `position` the decode step of the token after
  // it. Returns the emitted tokens: the next one, or the drafts accepted and
  // the token after them.
  std::vector<int64_t> step(const std::vector<int64_t>& ids, int64_t start, int64_t position,
                            const std::vector<int64_t>& context, const std::vector<int64_t>& drafts = {}) {
    const auto n = static_cast<executorch::aten::SizesType>(ids.size());
    std::vector<int64_t> positions(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) positions[i] = start + static_cast<int64_t>(i);
    inputs_[contract::kInputIds] = make_tensor_ptr(Sizes{1, n}, std::vector<int64_t>(ids));
    inputs_[contract::kCachePosition] = make_tensor_ptr(batched_ ? Sizes{1, n} : Sizes{n}, std::move(positions));
    inputs_["position"]->mutable_data_ptr<int64_t>()[0] = position;
    if (history_size_) {
      // A row per token sampled (the program samples as many rows as the
      // history has): the last tokens of context + drafts[:i], -1 after.
      const auto rows = static_cast<executorch::aten::SizesType>(drafts.size() + 1);
      std::vector<int64_t> h(static_cast<size_t>(rows) * history_size_, -1);
      if (penalized_) {
        std::vector<int64_t> seen = context;
        for (int64_t i = 0; i < rows; ++i) {
          if (i) seen.push_back(drafts[i - 1]);
          const size_t take = std::min<size_t>(seen.size(), context_size_);
          std::copy(seen.end() - take, seen.end(), h.begin() + i * history_size_);
        }
      }
      inputs_["history"] = make_tensor_ptr(Sizes{rows, static_cast<executorch::aten::SizesType>(history_size_)},
                                           std::move(h));
    }
    auto& method = *forward_.method;
    for (size_t i = 0; i < md_.input_names.size(); ++i) {
      const std::string& name = md_.input_names[i];
      auto it = inputs_.find(name);
      if (it == inputs_.end()) throw std::runtime_error("this runner does not know the program's input '" + name + "'");
      check(method.set_input(et::EValue(*it->second), i), "setting input '" + name + "'");
    }
    forward_.execute();
    const auto& out = method.get_output(0).toTensor();
    std::vector<int64_t> emitted;
    int64_t token;
    if (md_.samples) {
      // -1 ends the emitted tokens (a first -1: nothing could be sampled)
      const int64_t* tokens = out.const_data_ptr<int64_t>();
      emitted.push_back(tokens[0]);
      for (ssize_t i = 1; i < out.numel() && tokens[i] >= 0; ++i) emitted.push_back(tokens[i]);
    } else {  // logits [1, 1, V] (float32): greedy as the sampler (lowest index on ties,
              // NaN never chosen, -1 when every logit is NaN or -inf)
      const float* logits = out.const_data_ptr<float>();
      const int64_t V = out.size(out.dim() - 1);
      const float* row = logits + (out.numel() - V);
      token = -1;
      float best = -INFINITY;
      for (int64_t v = 0; v < V; ++v) {
        if (row[v] > best) best = row[v], token = v;
      }
      emitted.push_back(token);
    }
    for (int64_t t : emitted) {
      if (t < 0 || t >= md_.vocab_size) {
        throw std::runtime_error("the model produced no valid token (id " + std::to_string(t) +
                                 "): its logits are all NaN or -inf");
      }
    }
    return emitted;
  }

 private:
  LoadedMethod& forward_;
  const Metadata& md_;
  int64_t context_size_;
  bool penalized_;
  int64_t history_size_ = 0;  // 0: the program takes no history
  bool batched_ = false;  // a batched program (export --max-batch): cache_position [1, S], one row of sampler values
  std::map<std::string, TensorPtr> inputs_;
};

// Drafters (llm/run/drafting.py has the same): the tokens after `context`, at most k.
struct Drafter {
  virtual ~Drafter() = default;
  // `position`: the decode step of the token after `context`.
  virtual std::vector<int64_t> propose(const std::vector<int64_t>& context, int64_t k, int64_t position) = 0;
  // Called with the prompt while the target prefills it.
  virtual void prefill(const std::vector<int64_t>&) {}
};

// The tokens that followed the latest earlier occurrence of the context's
// last 3 (down to 1: the contract's n-gram sizes) tokens with k tokens after
// it (else the one with the most).
struct PromptLookup : Drafter {
  std::vector<int64_t> propose(const std::vector<int64_t>& context, int64_t k, int64_t) override {
    const auto len = static_cast<int64_t>(context.size());
    for (int64_t n = std::min<int64_t>(contract::kPromptLookupMaxNgram, len - 1); n >= contract::kPromptLookupMinNgram;
         --n) {
      int64_t best_from = 0, best = 0;
      for (int64_t start = len - n - 1; start >= 0 && best < k; --start) {
        if (std::equal(context.end() - n, context.end(), context.begin() + start)) {
          const int64_t from = start + n, follows = std::min(len, from + k) - from;
          if (follows > best) best_from = from, best = follows;
        }
      }
      if (best) return std::vector<int64_t>(context.begin() + best_from, context.begin() + best_from + best);
    }
    return {};
  }
};

// A smaller program of the same tokenizer decodes the drafts with the
// target's sampler settings. It prefills the prompt with the target; its KV
// cache is rolled back by position: each round starts where what it holds
// first differs from the context.
struct DraftModel : Drafter {
  DraftModel(LoadedMethod& forward, const Metadata& md, const Options& o) : md_(md), gen_(forward, md, o) {}

  void prefill(const std::vector<int64_t>& prompt) override {
    // (a prompt beyond the draft's context is left to the rounds, which then draft nothing)
    if (static_cast<int64_t>(prompt.size()) < md_.max_context) feed(prompt, reusable(prompt), 0);
  }

  std::vector<int64_t> propose(const std::vector<int64_t>& context, int64_t k, int64_t position) override {
    k = std::min(k, md_.max_context - static_cast<int64_t>(context.size()));  // the last draft's entry must fit
    int64_t cached = reusable(context);
    std::vector<int64_t> drafts, seen = context;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t token = feed(seen, cached, position + i);
      cached = static_cast<int64_t>(seen.size());
      drafts.push_back(token);
      seen.push_back(token);
    }
    return drafts;
  }

 private:
  // How many leading ids of `context` its cache holds (at least one is run).
  int64_t reusable(const std::vector<int64_t>& context) const {
    const auto len = static_cast<int64_t>(context.size());
    int64_t cached = 0;
    while (cached < static_cast<int64_t>(cached_.size()) && cached < len - 1 && cached_[cached] == context[cached]) {
      ++cached;
    }
    return cached;
  }

  // Runs context[cached:] (in chunks) through the draft; the token it samples after `context`.
  int64_t feed(const std::vector<int64_t>& context, int64_t cached, int64_t position) {
    int64_t token = 0;
    for (auto start = static_cast<size_t>(cached); start < context.size(); start += md_.max_chunk) {
      const size_t end = std::min(context.size(), start + md_.max_chunk);
      cached_.resize(start);
      token = gen_.step(std::vector<int64_t>(context.begin() + start, context.begin() + end),
                        static_cast<int64_t>(start), position, context)[0];
      cached_.insert(cached_.end(), context.begin() + start, context.begin() + end);
    }
    return token;
  }

  const Metadata& md_;
  Generator gen_;
  std::vector<int64_t> cached_;  // the ids its cache holds, from position 0
};

// How many tokens to draft next (llm/run/drafting.py's DraftLength, its
// numbers from the generated contract).
struct DraftLength {
  int64_t most, k, pause = 0, backoff = contract::kDraftBackoffMin;
  bool adaptive;
  DraftLength(int64_t most, bool adaptive)
      : most(most), k(adaptive ? std::min(most, contract::kDraftStart) : most), adaptive(adaptive) {}
  int64_t next() {
    if (pause) return --pause, 0;
    return k;
  }
  void update(int64_t drafted, int64_t accepted) {
    if (!adaptive || !drafted) return;
    k = accepted == drafted ? std::min(most, k + 2) : std::max<int64_t>(1, accepted + 1);
    if (accepted) {
      backoff = contract::kDraftBackoffMin;
    } else if (drafted == 1) {
      pause = backoff, backoff = std::min(contract::kDraftBackoffMax, contract::kDraftBackoffGrowth * backoff);
    }
  }
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// A program's weights file (export --external-weights), mapped: `given`
// (--data), else the file its metadata names, beside the program. Empty for
// a program that holds its weights.
struct WeightsData {
  std::optional<emlx::files::DataFile> file;

  WeightsData(const std::string& pte, const std::string& weights_file, const std::string& given) {
    if (weights_file.empty()) {
      if (!given.empty()) throw UsageError(pte + " holds its weights: it takes no --data file");
      return;
    }
    std::string path = given;
    if (path.empty()) {
      const auto slash = pte.find_last_of('/');
      path = (slash == std::string::npos ? "" : pte.substr(0, slash + 1)) + weights_file;
    }
    if (!std::ifstream(path).good()) {
      throw std::runtime_error(pte + " keeps its weights in " + weights_file + "; " + path +
                               " cannot be read (keep the two files together, or give --data)");
    }
    file.emplace(path);
  }

  const et::NamedDataMap* get() const { return file ? file->map() : nullptr; }
};

std::string ids_text(const std::set<int64_t>& ids) {
  std::string text;
  for (auto id : ids) text += (text.empty() ? "" : ",") + std::to_string(id);
  return "[" + text + "]";
}

int run(const Options& o) {
  et::runtime_init();
  if (!emlx_registered()) throw std::runtime_error("the MLX backend plugin failed to register");
  emlx::files::ProgramFile file(o.pte);
  et::Program& program = file.program();
  const Metadata md = read_metadata(program);

  const auto prompt_len = static_cast<int64_t>(o.prompt.size());
  if (prompt_len >= md.max_context) {
    throw UsageError("the prompt has " + std::to_string(prompt_len) + " tokens; this program's max context is " +
                     std::to_string(md.max_context));
  }
  // Subtracted, not added: a huge --max-new-tokens would overflow the sum.
  if (o.max_new_tokens > md.max_context - prompt_len) {
    throw UsageError("prompt + --max-new-tokens exceeds the max context of " + std::to_string(md.max_context));
  }
  for (auto id : o.prompt) {
    if (id < 0 || id >= md.vocab_size) {
      throw UsageError("prompt token ids must be in [0, " + std::to_string(md.vocab_size) + ")");
    }
  }
  if (!md.samples && o.any_on()) {
    throw UsageError("this program returns logits (exported with --no-sampling): only greedy decoding");
  }

  // The memory budget of this program alone: a load-time option of our backend.
  et::BackendOptions<1> budget;
  et::LoadBackendOptionsMap options;
  if (o.memory_budget_kib) {
    check(budget.set_option("memory_budget_kib", static_cast<int>(o.memory_budget_kib)), "--memory-budget-kib");
    check(options.set_options(emlx_backend_id(), budget.view()), "--memory-budget-kib");
  }
  const WeightsData weights(o.pte, md.weights_file, o.data);
  LoadedMethod forward(program, "forward", o.memory_budget_kib ? &options : nullptr, weights.get());
  Generator gen(forward, md, o);

  std::unique_ptr<Drafter> drafter;
  std::optional<emlx::files::ProgramFile> draft_file;
  std::optional<WeightsData> draft_weights;
  std::unique_ptr<LoadedMethod> draft_forward;
  Metadata draft_md;
  if (o.prompt_lookup || !o.draft_model.empty()) {
    if (!md.max_draft_tokens) {
      throw UsageError("this program verifies no drafts (exported with --max-draft-tokens 0, --no-sampling or "
                       "before speculative decoding): re-export it to use a drafter");
    }
    if (o.num_draft_tokens > md.max_draft_tokens) {
      throw UsageError("--num-draft-tokens must be in [1, " + std::to_string(md.max_draft_tokens) +
                       "] (this program's --max-draft-tokens)");
    }
  }
  if (o.prompt_lookup) {
    drafter = std::make_unique<PromptLookup>();
  } else if (!o.draft_model.empty()) {
    draft_file.emplace(o.draft_model);
    draft_md = read_metadata(draft_file->program());
    auto mismatch = [](const char* what, const std::string& draft, const std::string& target) {
      return std::runtime_error(std::string("the draft model's ") + what + " (" + draft + ") is not the target's (" +
                                target + "): a draft model must share the target's tokenizer");
    };
    if (!draft_md.samples) throw std::runtime_error("the draft program returns logits (exported with --no-sampling)");
    if (draft_md.vocab_size != md.vocab_size) {
      throw mismatch("vocabulary size", std::to_string(draft_md.vocab_size), std::to_string(md.vocab_size));
    }
    if (draft_md.eos_ids != md.eos_ids) throw mismatch("eos ids", ids_text(draft_md.eos_ids), ids_text(md.eos_ids));
    if (draft_md.bos_id != md.bos_id) {
      throw mismatch("bos id", std::to_string(draft_md.bos_id), std::to_string(md.bos_id));
    }
    draft_weights.emplace(o.draft_model, draft_md.weights_file, "");
    draft_forward = std::make_unique<LoadedMethod>(draft_file->program(), "forward", nullptr, draft_weights->get());
    drafter = std::make_unique<DraftModel>(*draft_forward, draft_md, o);
  }
  DraftLength length(o.num_draft_tokens ? o.num_draft_tokens : md.max_draft_tokens, !o.fixed_draft_length);
  auto t0 = std::chrono::steady_clock::now();
  int64_t token = 0;
  for (int64_t start = 0; start < prompt_len; start += md.max_chunk) {
    const int64_t end = std::min(prompt_len, start + md.max_chunk);
    token = gen.step(std::vector<int64_t>(o.prompt.begin() + start, o.prompt.begin() + end), start, 0, o.prompt)[0];
  }
  if (drafter && o.max_new_tokens > 1) drafter->prefill(o.prompt);  // (one token: no round drafts)
  const double prefill_s = seconds_since(t0);
  std::vector<int64_t> out = {token}, context = o.prompt;
  double decode_s = 0;
  int64_t drafted = 0, accepted = 0;
  bool done = md.eos_ids.count(token) || static_cast<int64_t>(out.size()) >= o.max_new_tokens;
  while (!done) {
    const auto n = static_cast<int64_t>(out.size());
    context.push_back(token);  // not in the cache yet: this call writes it at `position`
    const int64_t position = prompt_len + n - 1;
    auto t = std::chrono::steady_clock::now();  // a step's time includes its drafting
    std::vector<int64_t> drafts;
    if (drafter) {
      // the emitted tokens (drafts + 1) fit --max-new-tokens, their entries the cache
      const int64_t k = std::min({length.next(), o.max_new_tokens - n - 1, md.max_context - 1 - position});
      if (k > 0) drafts = drafter->propose(context, k, n);
    }
    std::vector<int64_t> fed = {token};
    fed.insert(fed.end(), drafts.begin(), drafts.end());
    const std::vector<int64_t> emitted = gen.step(fed, position, n, context, drafts);
    decode_s += seconds_since(t);
    drafted += static_cast<int64_t>(drafts.size());
    accepted += static_cast<int64_t>(emitted.size()) - 1;
    length.update(static_cast<int64_t>(drafts.size()), static_cast<int64_t>(emitted.size()) - 1);
    for (size_t i = 0; i < emitted.size() && !done; ++i) {
      token = emitted[i];
      if (i) context.push_back(out.back());
      out.push_back(token);
      done = md.eos_ids.count(token) || static_cast<int64_t>(out.size()) >= o.max_new_tokens;
    }
  }
  std::printf("ids:");
  for (auto id : out) std::printf(" %lld", static_cast<long long>(id));
  std::printf("\nprefill: %lld tokens, %.1f tokens/s\n", static_cast<long long>(prompt_len), prompt_len / prefill_s);
  const size_t steps = out.size() - 1;
  std::printf("decode: %zu tokens, %.1f tokens/s\n", steps, steps ? steps / decode_s : 0.0);
  if (drafter) {
    std::printf("drafts: %lld drafted, %lld accepted\n", static_cast<long long>(drafted),
                static_cast<long long>(accepted));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
#if defined(__linux__)
  // The OpenBLAS our kernels call (single-threaded, from their own threads)
  // starts a thread as it loads that spins for about 0.1 s, a core taken
  // from loading and the first prefill, unless OPENBLAS_NUM_THREADS is set
  // by then: set it and start again (on failure, go on as we are).
  char self[4096];
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length > 0 && !std::getenv("OPENBLAS_NUM_THREADS") && setenv("OPENBLAS_NUM_THREADS", "1", 1) == 0) {
    self[length] = '\0';
    execv(self, argv);  // (by its own path: the process keeps its name)
  }
#endif
  try {
    return run(parse_args(argc, argv));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "emlx_runner: error: %s\n", e.what());
    std::string flags;
    for (int i = 0; i < kNumSamplerInputs; ++i) {
      if (!has_flag(i)) continue;
      std::string metavar = kSamplerInputs[i].name;
      for (char& c : metavar) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      flags += std::string(" [") + kSamplerInputs[i].cli + " " + metavar + "]";
    }
    std::fprintf(stderr,
                 "usage: emlx_runner MODEL.pte --prompt-ids ID,ID,... [--max-new-tokens N] [--seed S]\n      %s\n"
                 "       [--repetition-context-size N] [--logit-bias ID=VALUE]... [--memory-budget-kib N]\n"
                 "       [--data MODEL.ptd]\n"
                 "       [--prompt-lookup | --draft-model DRAFT.pte] [--num-draft-tokens K] [--fixed-draft-length]\n",
                 flags.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emlx_runner: error: %s\n", e.what());
    return 1;
  }
}
