"""A tiny random-weight Llama model with a locally trained tokenizer, for demos and tests.

No model hub is needed: :func:`build_tiny_model` writes a Hugging Face model directory
that vLLM (and SGLang) load like any other: ``config.json`` + ``model.safetensors`` and
a byte-level BPE tokenizer of exactly 2048 tokens with a chat template. The shapes
(:data:`SHAPES`): ``tiny`` (Llama, 2 layers, hidden 128, 4 attention heads, 2 KV heads,
about 3 MB; tests and demo), ``window`` (``tiny`` whose second layer attends to the last
40 tokens only, a sliding window as in Gemma 2/3, gpt-oss and Mistral models), ``bench``
(Llama, 8 layers, hidden 512, 8 heads, 4 KV heads, about 110 MB; enough compute per
layer for the serving benchmark to show streaming) and ``mla`` (DeepSeek-V2, 2 layers,
hidden 128, 4 heads, multi-head latent attention with a 512 + 64 latent per token, the
only size vLLM's CPU MLA kernel takes; dense MLPs; about 5 MB) and ``hybrid``
(GraniteMoeHybrid as in IBM's Granite 4.0-H, 4 layers alternating Mamba2 state-space
mixers and attention, dense MLPs, hidden 128; about 4 MB) and ``gdn`` (Qwen3-Next, 4
layers alternating Gated DeltaNet linear attention and attention, the last layer's MLP
a mixture of 4 experts as vLLM's Qwen3-Next needs one, hidden 128; vLLM's CPU kernel
takes 128-value heads and bfloat16 only; about 7 MB) and ``shortconv`` (LFM2 as in
Liquid AI's models, 4 layers alternating gated short convolutions of width 3 and
attention, hidden 128; about 5 MB) and ``swa`` (Poolside's Laguna, 4 layers alternating
full attention and a 40-token sliding window, dense MLPs, hidden 128: an architecture
SGLang keeps in its hybrid sliding-window pool, whose window layers hold only their
window's pages; about 4 MB).

Contract:

- Deterministic: the same ``seed`` gives the same weights; the tokenizer is the same for
  every seed (so models of different seeds share token ids, e.g. to test a KV cache
  arriving from the wrong model).
- Atomic: the model is built in a temporary directory beside ``path`` and renamed into
  place, with a marker file written last. A crashed build never leaves a partial model at
  ``path``; its leftover temporary directory is removed by the next build.
- Safe to call from several processes at once: builders serialise on a lock file beside
  ``path`` (``fcntl.flock``); the second one finds the first one's model and returns.
- ``torch``, ``transformers`` and ``tokenizers`` are imported inside the build only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from kvbridge.errors import DeadlineExceeded, KVBridgeError

RECIPE = 1
"""Bump when the weights or the tokenizer a seed produces change."""
MARKER = "kvbridge-model.json"
"""Written last into a complete model directory."""

VOCAB_SIZE = 2048
_TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
SHAPES: dict[str, dict[str, int]] = {
    "tiny": _TINY,
    "bench": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "window": {**_TINY, "sliding_window": 40},
    "mla": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
    },
    # a Mamba2 state (conv 3 x 272 + SSM 8 x 32 x 8 floats, 11456 bytes) fits in an
    # attention block of 32 tokens (16 KiB), so vLLM keeps --block-size 32
    "hybrid": {
        **_TINY,
        "num_hidden_layers": 4,
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_d_state": 8,
    },
    "gdn": {
        **_TINY,
        "num_hidden_layers": 4,
        "head_dim": 64,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    },
    "shortconv": {**_TINY, "num_hidden_layers": 4, "conv_L_cache": 3},
    "swa": {**_TINY, "num_hidden_layers": 4, "sliding_window": 40, "head_dim": 32},
}
"""Model shapes by name (float32, vocab 2048); those with ``kv_lora_rank`` are DeepSeek-V2
(MLA), those with ``mamba_n_heads`` GraniteMoeHybrid (Mamba2 layers first, then every
other layer), those with ``linear_num_value_heads`` Qwen3-Next (the same with Gated
DeltaNet layers), those with ``conv_L_cache`` LFM2 (the same with short convolutions),
those with ``head_dim`` and ``sliding_window`` Laguna, the others Llama. With
``sliding_window``, every second layer attends to that many past tokens only
(``layer_types`` in ``config.json``, which vLLM reads; transformers' Llama ignores it)."""
MAX_POSITIONS = 8192
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]  # ids 0, 1, 2, 3

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ "
    "message['content'] }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt "
    "%}<|assistant|>\n{% endif %}"
)

_TOKENIZER_SEED = 20240601  # the tokenizer does not depend on the model's seed


def architecture(shape: str) -> str:
    """``"deepseek-v2"`` for the MLA shapes, ``"granitemoehybrid"``, ``"qwen3-next"`` and
    ``"lfm2"`` for the hybrid ones, ``"laguna"`` for ``swa``, else ``"llama"``."""
    if "kv_lora_rank" in SHAPES[shape]:
        return "deepseek-v2"
    if "linear_num_value_heads" in SHAPES[shape]:
        return "qwen3-next"
    if "conv_L_cache" in SHAPES[shape]:
        return "lfm2"
    if _is_laguna(SHAPES[shape]):
        return "laguna"
    return "granitemoehybrid" if "mamba_n_heads" in SHAPES[shape] else "llama"


def _is_laguna(shape: dict[str, int]) -> bool:
    return "sliding_window" in shape and "head_dim" in shape


def has_states(shape: str) -> bool:
    """Whether the model of ``shape`` has state-space layers (Mamba2, Gated DeltaNet,
    short convolutions), whose states vLLM keeps per request with prefix caching off."""
    return architecture(shape) in ("granitemoehybrid", "qwen3-next", "lfm2")


def default_model_dir(shape: str = "tiny") -> Path:
    """``$KVBRIDGE_CACHE_DIR/<shape>-<architecture>`` (``tiny-llama``), else the same under
    ``~/.cache/kvbridge``."""
    root = os.environ.get("KVBRIDGE_CACHE_DIR")
    return (
        Path(root) if root else Path.home() / ".cache" / "kvbridge"
    ) / f"{shape}-{architecture(shape)}"


def read_marker(path: Path) -> dict | None:
    """The build record of a complete model at ``path``; ``None`` when there is none."""
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def build_tiny_model(
    path: Path, *, seed: int = 0, shape: str = "tiny", lock_timeout: float = 600.0
) -> Path:
    """Build the model of ``shape`` (see :data:`SHAPES`) at ``path`` unless a complete
    one is already there.

    Returns ``path``. Raises :class:`~kvbridge.errors.KVBridgeError` when ``path`` holds
    something else (another seed or recipe, or a directory that is not ours), and
    :class:`~kvbridge.errors.DeadlineExceeded` when another builder holds the lock for
    more than ``lock_timeout`` seconds.
    """
    if shape not in SHAPES:
        raise KVBridgeError(
            f"unknown model shape {shape!r}", fix=f"use one of: {', '.join(SHAPES)}"
        )
    path = Path(path).expanduser().absolute()
    want = {"recipe": RECIPE, "seed": seed, "vocab_size": VOCAB_SIZE, "shape": shape}
    if _check(path, want):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent / f".{path.name}.lock", lock_timeout):
        if _check(path, want):  # built by another process while we waited
            return path
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # crashed builds; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        if path.exists():
            try:
                path.rmdir()  # an empty directory is harmless; anything else is not ours
            except OSError:
                raise KVBridgeError(
                    f"{path} exists but holds no complete kvbridge model ({MARKER} is missing)",
                    fix=f"remove {path}, or pass another path",
                ) from None
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            _build(tmp, seed, SHAPES[shape])
            (tmp / MARKER).write_text(json.dumps(want, indent=1) + "\n")
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return path


def _check(path: Path, want: dict) -> bool:
    """True if ``path`` holds the model ``want`` describes; raises if it holds another."""
    have = read_marker(path)
    if have is None:
        return False
    have.setdefault("shape", "tiny")  # markers written before shapes existed
    if {k: have.get(k) for k in want} != want:
        raise KVBridgeError(
            f"{path} holds a different model ({have}, wanted {want})",
            fix=f"remove {path}, or pass another path",
        )
    return True


class _locked:
    """``flock`` on ``lock_path``, polled until ``timeout`` (flock itself has no deadline)."""

    def __init__(self, lock_path: Path, timeout: float) -> None:
        self.lock_path, self.timeout = lock_path, timeout

    def __enter__(self) -> None:
        self.fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    raise DeadlineExceeded(
                        f"another process held {self.lock_path} for more than {self.timeout}s",
                        fix="wait for the other build to finish, or stop it",
                    ) from None
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _build(out: Path, seed: int, shape: dict[str, int]) -> None:
    import torch
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        LagunaConfig,
        LagunaForCausalLM,
        Lfm2Config,
        Lfm2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    _build_tokenizer(out)
    common = dict(
        vocab_size=VOCAB_SIZE,
        **shape,
        max_position_embeddings=MAX_POSITIONS,
        # larger than Llama's 0.02 so logits are peaked: greedy decoding then has clear
        # winners and outputs compare token for token across batchings and instances
        initializer_range=0.2,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        tie_word_embeddings=False,
        dtype="float32",
    )
    if "kv_lora_rank" in shape:
        config = DeepseekV2Config(
            **common,
            q_lora_rank=None,
            # dense MLPs in every layer (the experts are declared, never built)
            first_k_dense_replace=shape["num_hidden_layers"],
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=64,
            moe_layer_freq=1,  # SGLang reads moe_layer_freq
            # SGLang's CPU rotary embedding is DeepSeek's YaRN only; factor 1 leaves the
            # frequencies as plain RoPE's
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 1.0,
                "original_max_position_embeddings": MAX_POSITIONS,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
        model_cls = DeepseekV2ForCausalLM
    elif "mamba_n_heads" in shape:
        config = GraniteMoeHybridConfig(
            **common,
            layer_types=["mamba", "attention"] * (shape["num_hidden_layers"] // 2),
            num_local_experts=0,
            shared_intermediate_size=shape["intermediate_size"],  # a dense MLP per layer
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=64,
            position_embedding_type="rope",
        )
        model_cls = GraniteMoeHybridForCausalLM
    elif "linear_num_value_heads" in shape:
        layers = shape["num_hidden_layers"]
        config = Qwen3NextConfig(
            **common,
            layer_types=["linear_attention", "full_attention"] * (layers // 2),
            linear_conv_kernel_dim=4,
            mlp_only_layers=list(range(layers - 1)),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
        model_cls = Qwen3NextForCausalLM
    elif "conv_L_cache" in shape:
        config = Lfm2Config(
            **common,
            layer_types=["conv", "full_attention"] * (shape["num_hidden_layers"] // 2),
            block_auto_adjust_ff_dim=False,  # the MLP keeps intermediate_size
        )
        # what vLLM reads besides transformers' fields (LiquidAI's configs carry them)
        config.conv_dim = config.conv_dim_out = config.block_dim = shape["hidden_size"]
        model_cls = Lfm2ForCausalLM
    elif _is_laguna(shape):
        layers = shape["num_hidden_layers"]
        config = LagunaConfig(
            **common,
            layer_types=["full_attention", "sliding_attention"] * (layers // 2),
            mlp_layer_types=["dense"] * layers,  # no experts
        )
        model_cls = LagunaForCausalLM
    else:
        if "sliding_window" in shape:
            common["layer_types"] = ["full_attention", "sliding_attention"] * (
                shape["num_hidden_layers"] // 2
            )
        config, model_cls = LlamaConfig(**common), LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG alone
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
    with _quiet_progress_bars():
        model.save_pretrained(out)


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(_TOKENIZER_SEED)), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise KVBridgeError(
            f"the tokenizer has {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}",
            fix="the training corpus is too small: this is a kvbridge bug",
        )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)
    # the class name transformers 4 knows too (5 calls it TokenizersBackend, an alias)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


_ENGLISH = (
    "The quick brown fox jumps over the lazy dog. A prefill instance computes the KV cache "
    "of a prompt and a decode instance generates the answer one token at a time. "
    "Hello, world! What is the capital of France? Paris is the capital of France. "
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 4096. user assistant system"
)


def _corpus(rng: random.Random) -> Iterator[str]:
    """Deterministic text: English snippets plus made-up words, rich enough in byte pairs
    to train a 2048-token BPE vocabulary."""
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels] + [
        v + c for v in vowels for c in "nrst"
    ]
    words = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(4000)})
    weights = [1.0 / (rank + 1) for rank in range(len(words))]  # Zipf-like
    for i in range(3000):
        if i % 10 == 0:
            yield _ENGLISH
        n = rng.randint(4, 16)
        sentence = " ".join(rng.choices(words, weights, k=n))
        yield (
            sentence.capitalize()
            + rng.choice([".", ".", "!", "?", ","])
            + f" {rng.randint(0, 9999)}"
        )
