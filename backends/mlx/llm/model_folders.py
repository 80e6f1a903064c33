"""Small Hugging Face model folders with random weights, for the demo and tests.

A folder holds what a real one does: `config.json`, safetensors weights, and a
tokenizer (`tokenizer.json` + its config) trained on the fly with the
`tokenizers` library on a little local text. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

# The families the tests export and hold to transformers' greedy output.
FAMILIES = ("llama", "qwen2", "qwen3", "gemma", "gemma3", "phi3", "mistral", "olmo2", "stablelm", "starcoder2",
            "falcon", "qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_5_text", "lfm2",
            "qwen3_5_moe_text", "lfm2_moe", "granitemoehybrid", "nemotron_h", "falcon_h1", "mamba2", "jamba",
            "gemma4_text", "gemma3n_text", "llama4_text")

TEXT = """\
The quick brown fox jumps over the lazy dog. A small model runs on the device
and writes one token at a time. Once upon a time there was a tiny language
model that lived in a file. It read the prompt, filled its cache, and then it
spoke: every word came from the logits, sampled on the device, never copied to
the host. The sun rose over the hills, the river ran to the sea, and the
engineers measured tokens per second, again and again, until the numbers held.
"""

BOS, EOS = "<s>", "</s>"
# ChatML, as Qwen's and SmolLM's instruct folders carry it: `<|im_end|>` ends a turn.
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
# Qwen 2.5's tool markers: added tokens, but not special ones (they are text).
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
# ChatML with Qwen 2.5's tools (Hermes' <tool_call> format): a system block
# lists the tools (with shorter instructions than Qwen's), an assistant's
# calls and the tools' answers are rendered as Qwen renders them. Without
# tools it is plain ChatML.
CHATML = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0].role == 'system' %}"
    "{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n<tools>' }}{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nFor each call:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message.role == 'system' %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant\\n' + (message.content or '') }}{% for call in message.tool_calls %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + "
    "(call.function.arguments | tojson) + '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# What a chat folder's tokenizer also learns: the characters of tool calls
# (JSON and its markup), so that a random model can write one.
TOOL_TEXT = """\
# Tools
<tools>
{"type": "function", "function": {"name": "add", "description": "Add", "parameters": {"type": "object",
"properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
"additionalProperties": false}}}
</tools>
For each call:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": "celsius", "ok": true}}
</tool_call>
[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -2.5e+10, false, null, {"a_b": "x\\\\y/z"}]
"""


# Multi-byte characters for the all-bytes tokenizer's merges.
WIDE_TEXT = "naïve café — “quoted” 日本語の文章 ⚡ emoji 🙂 façade über 東京 — ½ €5 "


def train_tokenizer(vocab_size: int = 384, all_bytes: bool = False, extra_text: str = ""):
    """A byte-level BPE trained on TEXT in well under a second. Characters
    absent from TEXT have no token: prompts should use TEXT's characters.
    With `all_bytes`, every byte has a token too (and multi-byte characters
    are merged): sampled text then holds split and broken UTF-8, as a real
    byte-level tokenizer's does. `extra_text` is learned too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # By default the alphabet is TEXT's characters only (no raw bytes), so
    # that what a random-weight model generates decodes to printable text.
    alphabet = pre_tokenizers.ByteLevel.alphabet() if all_bytes else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=alphabet)
    tok.train_from_iterator([TEXT + extra_text + (WIDE_TEXT * 4 if all_bytes else "")] * 4, trainer)
    return tok


def _config(family: str, vocab: int, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                  # larger random weights give varied, peaked logits: greedy
                  # decoding then produces distinct tokens rather than ties
                  initializer_range=0.2)
    head_dim = hidden // heads
    if family == "llama":  # SmolLM-style: tied embeddings
        return tf.LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen2":
        return tf.Qwen2Config(**common)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=head_dim)
    if family == "gemma":
        return tf.GemmaConfig(**common, head_dim=head_dim)
    if family == "gemma3":  # sliding-window and full layers
        return tf.Gemma3TextConfig(**common, head_dim=head_dim, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                   + ["sliding_attention"] * (layers % 2))
    if family == "phi3":  # fused qkv and gate/up projections
        return tf.Phi3Config(**common)
    if family == "mistral":
        return tf.MistralConfig(**common, head_dim=head_dim, sliding_window=None)
    if family == "olmo2":  # RMSNorm on queries and keys, norms after each block
        return tf.Olmo2Config(**common)
    if family == "stablelm":  # LayerNorm, RoPE on a quarter of each head
        return tf.StableLmConfig(**common)
    if family == "starcoder2":  # LayerNorm and biases, a GELU MLP
        return tf.Starcoder2Config(**common, sliding_window=None)
    if family == "falcon":  # multi-query attention (one cached key/value head), a fused qkv projection
        return tf.FalconConfig(**{k: v for k, v in common.items()
                                  if k not in ("num_key_value_heads", "intermediate_size")})
    if family == "qwen3_moe":  # mixture of experts: softmax, then the top 2 of 4 experts, renormalised
        return tf.Qwen3MoeConfig(**common, head_dim=head_dim, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=intermediate // 4, norm_topk_prob=True)
    if family == "gpt_oss":  # experts with biases and a clamped gate, attention sinks, a sliding window
        return tf.GptOssConfig(**{**common, "max_position_embeddings": 131072}, head_dim=head_dim,
                               num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                               + ["sliding_attention"] * (layers % 2))
    if family == "deepseek_v3":  # latent attention (a compressed cache), experts routed within groups, a shared one
        return tf.DeepseekV3Config(**{**common, "num_key_value_heads": heads}, kv_lora_rank=16, q_lora_rank=32,
                                   qk_rope_head_dim=8, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
                                   n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=intermediate // 4,
                                   n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=0)
    # State layers (llm/export/state_cache.py): the layer kinds alternate, state first, an attention layer last
    kinds = [("linear_attention" if i < layers - 1 or layers == 1 else "full_attention") for i in range(layers)]
    if family == "qwen3_5_text":  # gated delta linear attention (two value heads per key head) and full attention
        return tf.Qwen3_5TextConfig(**common, head_dim=head_dim, linear_num_key_heads=2, linear_num_value_heads=4,
                                    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                    layer_types=kinds)
    if family == "lfm2":  # short causal convolutions and full attention
        return tf.Lfm2Config(**common, layer_types=[k.replace("linear_attention", "conv") for k in kinds])
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=intermediate // 4)
    if family == "qwen3_5_moe_text":  # Qwen3.5's layers with experts and a shared expert
        return tf.Qwen3_5MoeTextConfig(**common, **experts, head_dim=head_dim, linear_num_key_heads=2,
                                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                       shared_expert_intermediate_size=intermediate // 4, layer_types=kinds)
    if family == "lfm2_moe":  # LFM2 with experts after its first (dense) layer
        return tf.Lfm2MoeConfig(**common, **experts, num_dense_layers=1,
                                layer_types=[k.replace("linear_attention", "conv") for k in kinds])
    if family == "granitemoehybrid":  # Mamba-2 layers (Granite 4 hybrid) and attention
        return tf.GraniteMoeHybridConfig(**common, layer_types=kinds, mamba_n_heads=8, mamba_d_head=16,
                                         mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=64)
    if family == "nemotron_h":  # Mamba-2, attention and experts layers, each alone
        return tf.NemotronHConfig(**{**common, "num_hidden_layers": layers + 1}, layer_types=kinds + ["moe"],
                                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=intermediate // 4,
                                  mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1)
    if family == "falcon_h1":  # attention and Mamba-2 side by side in every layer
        return tf.FalconH1Config(**common, head_dim=head_dim, mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128,
                                 mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=64)
    if family == "mamba2":  # state layers only
        return tf.Mamba2Config(**{k: v for k, v in common.items() if "heads" not in k and k != "intermediate_size"},
                               num_heads=2 * hidden // 16, head_dim=16, state_size=16, n_groups=1, chunk_size=64)
    if family == "jamba":  # Mamba-1 layers, attention, experts every other layer
        return tf.JambaConfig(**common, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                              expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16)
    # Gemma 3n/4: sliding and full layers, per-layer inputs; from 3 layers on, the last reads the keys and values
    # of the last earlier layer of its kind (KV sharing)
    gemma = dict(head_dim=head_dim, sliding_window=8, hidden_size_per_layer_input=16, vocab_size_per_layer_input=vocab,
                 num_kv_shared_layers=1 if layers >= 3 else 0,
                 layer_types=(["sliding_attention", "full_attention"] * layers)[:layers])
    if family == "gemma4_text":  # full layers of twice the head size
        return tf.Gemma4TextConfig(**common, **gemma, global_head_dim=2 * head_dim)
    if family == "gemma3n_text":  # and AltUp and LAuReL
        return tf.Gemma3nTextConfig(**common, **gemma, laurel_rank=8)
    if family == "llama4_text":  # chunked attention (chunks of 8), experts, a layer without RoPE
        return tf.Llama4TextConfig(**common, head_dim=head_dim, attention_chunk_size=8, num_local_experts=4,
                                   num_experts_per_tok=1, intermediate_size_mlp=intermediate,
                                   no_rope_layers=[1, 0] * (layers // 2) + [1] * (layers % 2))
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")


def write_model_folder(path: str | Path, family: str = "llama", *, layers: int = 2, hidden: int = 64,
                       heads: int = 4, kv_heads: int = 2, intermediate: int = 128, seed: int = 0,
                       all_bytes: bool = False, chat: bool = False, tools: bool = False) -> Path:
    """Writes a random-weight `family` model and a trained tokenizer to `path`
    (`all_bytes`: see train_tokenizer). `chat`: an instruct folder's extras,
    the ChatML template (with Qwen's tools) with its two special tokens,
    `<|im_end|>` an eos id of generation_config.json only (as in Llama 3
    and Qwen folders). `tools`: the tokenizer also learns TOOL_TEXT and has
    the two tool-call tokens, so that the model can write a call."""
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    path = Path(path)
    tok = train_tokenizer(all_bytes=all_bytes, extra_text=TOOL_TEXT if tools else "")
    if chat:
        tok.add_special_tokens(list(CHAT_TOKENS))
    if tools:
        tok.add_tokens(list(TOOL_TOKENS))
    cfg = _config(family, tok.get_vocab_size(), layers, hidden, heads, kv_heads, intermediate)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if chat:
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=[1, tok.token_to_id(CHAT_TOKENS[1])],
                                                   pad_token_id=1, use_cache=True)
    model.save_pretrained(path)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    if chat:
        fast.chat_template = CHATML
    fast.save_pretrained(path)
    return path
