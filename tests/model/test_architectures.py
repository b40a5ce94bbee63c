"""Each supported family, written by HF transformers' own config class and `save_pretrained`, gives
transformers' logits in kvserve (fp32, within 1e-4) over a prompt and 32 greedy tokens on the
torch and cpu backends (sliding windows and Gemma 3: tests/model/test_gemma3.py); sliding windows
are read per layer as transformers reads them; what kvserve does not compute is refused naming the
field or architecture."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                          Phi3ForCausalLM, PreTrainedConfig, PreTrainedModel, Qwen2Config, Qwen3Config)

from kvserve import LLM, RequestOutput, SamplingParams
from kvserve.kernels import cpu_extension
from kvserve.model.architectures import UnsupportedModel
from kvserve.model.config import ModelConfig
from kvserve.model.loader import hf_state_dict, load_model
from kvserve.model.rope import LinearRopeScaling
from tests.model.test_loader import logits

CPU = torch.device("cpu")
# Ten times HF's initializer range (tests/conftest.py says why): sharp attention, varied tokens.
SHAPE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
         "initializer_range": 0.2}
# Short against the prompt and its 32 tokens, so the scaling changes the frequencies in use.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
FAMILIES: dict[str, Callable[[], PreTrainedConfig]] = {
    "llama3": lambda: LlamaConfig(**SHAPE, rope_scaling=LLAMA3_ROPE),
    "qwen2": lambda: Qwen2Config(**SHAPE),
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=32),  # not hidden / heads (16)
    "mistral": lambda: MistralConfig(**SHAPE, sliding_window=None),
    "mistral-wide-window": lambda: MistralConfig(**SHAPE, sliding_window=4096),  # covers every position
}
PROMPT = [(7 * i + 3) % 128 for i in range(20)]


def save_tiny(config: PreTrainedConfig, path: Path) -> PreTrainedModel:
    """A random fp32 model written by transformers. Norm weights and biases drawn too (transformers
    starts them at 1 and 0), so a q/k norm or a bias read into the wrong place changes the logits."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, PreTrainedModel]]:
    root = tmp_path_factory.mktemp("families")
    return {name: (root / name, save_tiny(make(), root / name)) for name, make in FAMILIES.items()}


def hf_logprobs(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_logprobs_equal_hf(hf: PreTrainedModel, prompt: list[int], out: RequestOutput, scored_prompt: bool) -> None:
    """`out`'s log-probabilities (with `scored_prompt`, its prompt's too) equal transformers' over
    the same tokens within 1e-4, and its greedy tokens are transformers' argmax."""
    ref = hf_logprobs(hf, prompt + out.token_ids)[:-1]
    outputs = ref[len(prompt) - 1:]
    assert (torch.stack([t.full for t in out.logprobs]) - outputs).abs().max().item() < 1e-4
    if scored_prompt:
        scored = torch.stack([p.full for p in out.prompt_logprobs[1:]])
        assert (scored - ref[:len(prompt) - 1]).abs().max().item() < 1e-4
    assert outputs.argmax(-1).tolist() == out.token_ids


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(tiny_models: dict, family: str, backend: str) -> None:
    """Chunked prefill (16-token budget, 20-token prompt), then 32 greedy steps: every prompt and
    output position's log-probabilities equal transformers' over the same tokens, and the greedy
    tokens are transformers' argmax. The torch backend runs the eager ops, the cpu one the kernels."""
    path, hf = tiny_models[family]
    llm = LLM(model=str(path), dtype="float32", device="cpu", attention_backend=backend,
              cpu_kernels=backend == "cpu", kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    assert_logprobs_equal_hf(hf, PROMPT, llm.generate([PROMPT], params, use_tqdm=False)[0], scored_prompt=True)


def test_the_llama3_scaling_changes_the_logits_under_test(tiny_models: dict) -> None:
    """Plain RoPE on the same weights gives other logits: ignoring `rope_scaling`, the fault this
    file guards against, fails the test above."""
    _, scaled = tiny_models["llama3"]
    plain = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=torch.float32)
    plain.load_state_dict(scaled.state_dict())
    ids = PROMPT * 3
    assert (hf_logprobs(plain.eval(), ids) - hf_logprobs(scaled, ids)).abs().max().item() > 1e-2


def refused(path: Path) -> str:
    with pytest.raises(UnsupportedModel) as err:
        load_model(path, torch.float32, CPU)
    return str(err.value)


def edit_config(path: Path, **changes: object) -> None:
    """config.json with `changes` made; a key given None is removed."""
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                  if not (k in changes and v is None)}))


def windows(path: Path) -> tuple[int | None, ...]:
    return load_model(path, torch.float32, CPU).config.layer_windows


def test_sliding_windows_are_read_per_layer_as_transformers_reads_them(tmp_path: Path) -> None:
    """Mistral windows every layer; Qwen2 the layers its layer_types mark (written by transformers
    from max_window_layers up), only under use_sliding_window; Gemma 3 its layer_types' sliding
    ones, or in older files all but every sliding_window_pattern-th. A window covering every
    position masks nothing and is read as none."""
    save_tiny(MistralConfig(**SHAPE, sliding_window=16), tmp_path / "mistral")
    assert windows(tmp_path / "mistral") == (16, 16)
    qwen = tmp_path / "qwen2"
    save_tiny(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=1), qwen)
    assert windows(qwen) == (None, 16)
    edit_config(qwen, layer_types=None)  # a file from before layer_types
    assert windows(qwen) == (None, 16)
    for switch in (False, None):  # Qwen2.5's files: off, and off when absent, as in transformers
        edit_config(qwen, use_sliding_window=switch)
        assert windows(qwen) == (None, None)
    edit_config(qwen, use_sliding_window=True, max_window_layers=2)
    assert windows(qwen) == (None, None)
    edit_config(qwen, max_window_layers=0, sliding_window=512)  # max_position_embeddings: 512
    assert windows(qwen) == (None, None)
    gemma = tmp_path / "gemma3"
    save_tiny(Gemma3TextConfig(**{**SHAPE, "num_key_value_heads": 1}, head_dim=16, sliding_window=16,
                               layer_types=["full_attention", "sliding_attention"]), gemma)
    assert windows(gemma) == (None, 16)
    edit_config(gemma, layer_types=None, sliding_window_pattern=2)
    assert windows(gemma) == (16, None)
    edit_config(gemma, layer_types=["sliding_attention", "local"])
    assert "layer_types: expected 2 of full_attention, sliding_attention" in refused(gemma)
    edit_config(gemma, layer_types=None, sliding_window=0)
    assert "sliding_window: expected a positive integer, got 0" in refused(gemma)


def test_an_older_gemma3_config_reads_as_transformers_5_writes_it(tmp_path: Path) -> None:
    """Hub files from before transformers 5: rope_theta and rope_scaling for the global layers,
    rope_local_base_freq for the local ones, sliding_window_pattern instead of layer_types."""
    shape = {**SHAPE, "num_hidden_layers": 6, "num_key_value_heads": 1}
    save_tiny(Gemma3TextConfig(**shape, head_dim=16, sliding_window=16, rope_local_base_freq=20000.0,
                               rope_theta=30000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}), tmp_path)
    new = load_model(tmp_path, torch.float32, CPU).config
    assert new.layer_windows == (16,) * 5 + (None,) and new.rope_local_theta == 20000.0
    edit_config(tmp_path, rope_parameters=None, layer_types=None, sliding_window_pattern=6, rope_theta=30000.0,
                rope_local_base_freq=20000.0, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert load_model(tmp_path, torch.float32, CPU).config == new


def test_options_gemma3_has_and_kvserve_does_not_compute_are_refused(tmp_path: Path) -> None:
    save_tiny(Gemma3TextConfig(**{**SHAPE, "num_key_value_heads": 1}, head_dim=16), tmp_path)
    edit_config(tmp_path, use_bidirectional_attention=True)
    assert "use_bidirectional_attention: true (EmbeddingGemma) is not implemented" in refused(tmp_path)
    edit_config(tmp_path, use_bidirectional_attention=False, hidden_activation="gelu")
    assert "hidden_activation: 'gelu' is not implemented" in refused(tmp_path)
    edit_config(tmp_path, hidden_activation="gelu_pytorch_tanh", rope_parameters={
        "full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "linear", "factor": 2.0}})
    assert "rope_parameters.sliding_attention: RoPE scaling on the sliding layers" in refused(tmp_path)


def test_an_unsupported_architecture_is_refused_naming_it(tmp_path: Path) -> None:
    config = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    Phi3ForCausalLM(config).save_pretrained(tmp_path)
    assert "architectures: 'Phi3ForCausalLM' is not supported" in refused(tmp_path)


def test_a_gemma3_model_config_writes_a_directory_transformers_reads(tmp_path: Path) -> None:
    """`ModelConfig.to_hf_dict` and `hf_state_dict` (what a converted GGUF is written with) give a
    directory that transformers runs to kvserve's logits, and that kvserve reads back equal."""
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                      num_kv_heads=1, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, max_position=256,
                      initializer_range=0.2, rope_scaling=LinearRopeScaling(8.0), qk_norm=True, sliding_window=8,
                      sliding_layers=(0, 1), rope_local_theta=1e4, hidden_act="gelu_pytorch_tanh",
                      norm_offset=True, sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=24)
    ours = load_model(cfg, torch.float32, CPU, seed=1).model
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.dim() == 1:
                p.copy_(0.3 * torch.randn_like(p))
    save_file(hf_state_dict(ours), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert load_model(tmp_path, torch.float32, CPU).config == cfg
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = [(7 * i + 3) % 128 for i in range(30)]
    got = torch.log_softmax(logits(ours, cfg, ids), dim=-1)
    assert (got - hf_logprobs(hf, ids)).abs().max().item() < 1e-4


def test_an_unknown_rope_type_is_refused_naming_the_field(tmp_path: Path) -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    save_tiny(LlamaConfig(**SHAPE, rope_scaling=yarn), tmp_path)
    assert "rope_parameters.rope_type: 'yarn' is not implemented" in refused(tmp_path)
    # The older spelling of config.json files written before transformers 5.
    edit_config(tmp_path, rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0})
    assert "rope_scaling.type: 'dynamic' is not implemented" in refused(tmp_path)
    edit_config(tmp_path, rope_scaling=LLAMA3_ROPE)
    assert load_model(tmp_path, torch.float32, CPU).config.rope_scaling is not None


# llama.cpp's tensor names for Qwen3 (gguf-py's MODEL_TENSORS[QWEN3]).
_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_writer(path: Path, arch: str, cfg: PreTrainedConfig, rope_theta: float) -> gguf.GGUFWriter:
    """A writer with the decoder's shape as llama.cpp's convert_hf_to_gguf writes it for `arch`."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return writer


def write_qwen3_gguf(model: PreTrainedModel, path: Path) -> None:
    """fp32 tensors and metadata as llama.cpp's convert_hf_to_gguf writes a Qwen3 (no q/k permutation:
    llama.cpp runs Qwen's RoPE rotate-half), with a byte-level tokenizer of the model's vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    cfg = model.config
    writer = gguf_writer(path, "qwen3", cfg, cfg.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    tokens = list(bytes_to_unicode().values())[:cfg.vocab_size - 1] + ["th"]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["t h"])
    writer.add_eos_token_id(0)
    for name, tensor in model.state_dict().items():
        if name in _GGUF_TOP:
            writer.add_tensor(_GGUF_TOP[name], tensor.numpy())
            continue
        _, _, layer, rest = name.split(".", 3)  # model.layers.N.<module>.<kind>
        module, kind = rest.rsplit(".", 1)
        writer.add_tensor(f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}", tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_qwen3_gguf_gives_the_logits_of_its_model(tiny_models: dict, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _, hf = tiny_models["qwen3"]
    write_qwen3_gguf(hf, tmp_path / "qwen3.gguf")
    with monkeypatch.context() as patch:  # the conversion's cache only: the kernels keep theirs
        patch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
        loaded = load_model(tmp_path / "qwen3.gguf", torch.float32, CPU)
    assert loaded.config.qk_norm and loaded.config.head_dim == 32
    with torch.no_grad():
        ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False)[0].tolist()
    ours = torch.log_softmax(logits(loaded.model, loaded.config, ids), dim=-1)
    assert (ours - hf_logprobs(hf, ids)).abs().max().item() < 1e-4


def test_an_unsupported_gguf_architecture_is_refused_naming_it(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(tmp_path / "phi3.gguf", "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert "general.architecture: 'phi3' is not supported" in refused(tmp_path / "phi3.gguf")


kernels = cpu_extension.load()
needs_bf16_kernels = pytest.mark.skipif(kernels is None or not kernels.has_bf16_gemm(),
                                        reason="needs the CPU kernels with AVX512-BF16 or AVX2")


@needs_bf16_kernels
def test_the_fused_cpu_stack_runs_llama3_rope_and_declines_qk_norms(tiny_models: dict,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The stack reads the model's scaled cos/sin tables: the same tokens and log-probabilities as
    the layered model. It has no q/k norms: a Qwen3 runs layered, and the log says why."""
    def run(family: str, stack: bool) -> tuple[LLM, list]:
        llm = LLM(model=str(tiny_models[family][0]), dtype="bfloat16", device="cpu", attention_backend="cpu",
                  cpu_fused_step=stack, kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4)
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=3)
        outs = llm.generate([PROMPT, PROMPT[:7]], params, use_tqdm=False)
        return llm, [(o.token_ids, o.logprobs) for o in outs]

    stacked, got = run("llama3", True)
    assert stacked.engine.runner.stack is not None
    assert got == run("llama3", False)[1]
    with caplog.at_level("INFO", logger="kvserve.engine.model_runner"):
        qwen3, _ = run("qwen3", True)
    assert qwen3.engine.runner.stack is None and "q/k norms per head" in caplog.text
