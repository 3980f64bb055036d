"""A tiny Llama with a locally trained tokenizer, built in seconds, no download.

The weights are random, so the text it writes is noise and it emits EOS at
random: tests that use it set `ignore_eos` and assert on token counts and
structure, never on text.

    python -m tests.tinymodel /tmp/tiny    # build by hand
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# ChatML: each turn is <|im_start|>role\ncontent<|im_end|>\n, and the generation prompt opens an
# assistant turn. With tools, a system turn lists them as JSON first; an assistant turn's tool calls
# are written as <tool_call>{"name": ..., "arguments": ...}</tool_call> (the form vLLM's `hermes`
# tool parser reads back), and a tool's result is a turn of its own. Content may be a string or a
# list of text parts (vLLM passes either, by the template's content format).
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}{{ '}</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "on",
    "for",
    "with",
    "by",
    "from",
    "at",
    "as",
    "is",
    "are",
    "was",
    "be",
    "it",
    "this",
    "that",
    "these",
    "those",
    "we",
    "you",
    "they",
    "he",
    "she",
    "model",
    "token",
    "request",
    "queue",
    "worker",
    "gateway",
    "engine",
    "stream",
    "latency",
    "price",
    "trade",
    "order",
    "market",
    "book",
    "fill",
    "system",
    "user",
    "assistant",
    "hello",
    "world",
    "please",
    "answer",
    "question",
    "count",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "red",
    "green",
    "blue",
    "fast",
    "slow",
    "high",
    "low",
    "buy",
    "sell",
]


def _corpus(n_lines: int = 2000, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    punct = [".", ",", "?", "!", ":", ";", "-", "'", '"', "(", ")", "\n"]
    lines = []
    for _ in range(n_lines):
        words = [rnd.choice(_WORDS) for _ in range(rnd.randint(3, 14))]
        if rnd.random() < 0.3:
            words.append(str(rnd.randint(0, 10_000)))
        lines.append(" ".join(words).capitalize() + rnd.choice(punct))
        if rnd.random() < 0.2:  # some JSON, as tool calls and structured answers are written
            lines.append(f'{{"{rnd.choice(_WORDS)}": "{rnd.choice(_WORDS)}", "n": {rnd.randint(0, 99)}}}')
    return lines


def _build_tokenizer(dest: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(dest))


def _build_model(dest: Path, vocab_size: int, pad_id: int, bos_id: int, eos_ids: list[int], *, hidden: int = 64,
                 layers: int = 2, max_positions: int = 2048) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        # vLLM's CPU attention only takes head sizes 32, 64, 80, ...: the
        # default (hidden / heads = 16) fails, so set it explicitly.
        head_dim=hidden // 2 if hidden <= 128 else 64,
        max_position_embeddings=max_positions,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_ids[0],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(dest), safe_serialization=True)
    # A chat turn ends at <|im_end|> as well as at </s>.
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=pad_id).save_pretrained(str(dest))


@contextmanager
def vllm_environment(root: Path) -> Iterator[dict[str, str]]:
    """What vLLM on this model runs in: private temp and cache dirs under `root`, loopback,
    offline, no usage stats; the process's environment restored afterwards."""
    env = {
        "TMPDIR": str(root / "tmp"),
        "VLLM_CACHE_ROOT": str(root / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
    }
    for key in ("TMPDIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in [*env, "VLLM_CPU_KVCACHE_SPACE"]}
    saved_tempdir = tempfile.tempdir
    os.environ.update(env)
    # kv_cache_memory_bytes sets the budget; this variable would override it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    tempfile.tempdir = env["TMPDIR"]
    try:
        yield env
    finally:
        tempfile.tempdir = saved_tempdir
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_tiny_model(dest: Path, *, hidden: int = 64, layers: int = 2, max_positions: int = 2048) -> Path:
    """Write the tokenizer and a random-weight bf16 Llama into `dest`; return it. A bench whose
    prefill must cost something asks for a wider, deeper one (`bench/prefix_affinity.py`)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(dest)
    vocab = json.loads((dest / "tokenizer.json").read_text())["model"]["vocab"]
    ids = {t: vocab[t] for t in SPECIAL_TOKENS}
    _build_model(dest, VOCAB_SIZE, ids["<pad>"], ids["<s>"], [ids["</s>"], ids["<|im_end|>"]], hidden=hidden,
                 layers=layers, max_positions=max_positions)
    return dest


if __name__ == "__main__":
    out = build_tiny_model(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-model"))
    print(out)
