"""Layer kinds and habits of single families that export handles: indexed
(sparse) attention beside sliding layers on rings (dots3-note, DeepSeek-V3.2's
kind), GPT-Neo's local layers in a cache longer than their window, Kimi's
delta attention (a decay per key channel), Zamba's Mamba scans one head at a
time, and a family whose code sizes its positions by the cache's length when
given no mask (OPT). Most run the program's module eagerly against
transformers (the kernels' own tests hold the runtime to the references)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from executorch_mlx.llm.export.hf_export import CachedLM, export_llm
from executorch_mlx.llm.export.options import ExportOptions
from executorch_mlx.llm.model_folders import BOS, EOS, train_tokenizer
from executorch_mlx.llm.run.runner import LLMRunner

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=230,
            bos_token_id=0, eos_token_id=1, pad_token_id=1, initializer_range=0.2)


def _prefill_in_calls(config, length: int, call: int, **cached) -> CachedLM:
    """Holds CachedLM (made with `cached`) over calls of `call` tokens of a
    random prompt to transformers' logits; returns the CachedLM."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(2, 230, (1, length))
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
        lm = CachedLM(model, 64, **cached)
        got = torch.cat([lm(ids[:, s:s + call], torch.arange(s, s + call), rows=call)[0]
                         for s in range(0, length, call)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    return lm


def test_indexed_attention_picks_its_keys_beside_ring_layers():
    # one indexed layer keeping 8 keys per query, one sliding layer (window 8) on a ring; past the first call
    # the indexer drops keys, which transformers masks out
    config = AutoConfig.for_model(
        "dots3_note_text", **TINY, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=8,
        layer_types=["indexed_attention", "sliding_attention"], sliding_window=8, mlp_layer_types=["dense", "dense"])
    lm = _prefill_in_calls(config, 24, 8, ring_chunk=8)
    assert lm.indexed == [0] and list(lm.rings) == [1]


def test_gpt_neo_local_layers_mask_by_position_in_a_longer_cache():
    config = AutoConfig.for_model("gpt_neo", **TINY, attention_types=[[["global", "local"], 1]], window_size=8)
    _prefill_in_calls(config, 24, 6)


def test_kimi_delta_attention_carries_its_state_across_calls():
    config = AutoConfig.for_model(
        "kimi_linear", **TINY, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, head_dim=8, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
        mlp_layer_types=["dense", "sparse"], layer_types=["linear_attention", "full_attention"], linear_head_dim=16,
        linear_num_heads=4)
    _prefill_in_calls(config, 24, 8, snapshots=3)


def test_zamba_scans_one_head_at_a_time_into_one_state():
    config = AutoConfig.for_model(
        "zamba", **{**TINY, "num_hidden_layers": 4}, num_key_value_heads=2, attention_hidden_size=128,
        attention_head_dim=16, attn_layer_period=2, attn_layer_offset=1, mamba_dt_rank=4, n_mamba_heads=2,
        layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"])
    _prefill_in_calls(config, 24, 8, snapshots=3)


def test_a_family_sized_by_its_cache_length_exports_with_a_full_mask(tmp_path):
    tok = train_tokenizer()
    config = AutoConfig.for_model("opt", **{**TINY, "vocab_size": tok.get_vocab_size(), "ffn_dim": 128,
                                            "word_embed_proj_dim": 64})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS).save_pretrained(tmp_path)
    pte = export_llm(tmp_path, tmp_path / "opt.pte", ExportOptions(max_context=64, sampling=False), progress=None)
    runner = LLMRunner(pte, tmp_path)
    ids = runner.tokenizer.encode("Once upon a time").ids
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)[0, len(ids):].tolist()
    assert runner.generate(ids, max_new_tokens=12).token_ids == want
