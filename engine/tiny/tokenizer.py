"""Offline tokenizers for the tiny random models (CLI process, test processes).

Nothing is downloaded: a byte-level BPE is trained with the `tokenizers` library on a corpus that
is generated here (an embedded English passage plus seeded pseudo-words), so the same
(family, vocab size) always gives the same tokenizer. Byte-level BPE can encode any text, and the
trainer fills the vocabulary exactly, so every id the model can emit decodes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mpic.types import ModelFamily

_PASSAGE = (
    "A picture is worth a thousand words. The user shows the assistant several images and asks "
    "questions about them: what is in the first image, how does the second one differ, which "
    "object is on the left, what colour is the sky, how many people are standing near the red "
    "car, is the dog sleeping or running, describe the scene in detail, compare the two charts, "
    "read the text on the sign, answer briefly. The assistant looks at each image and answers "
    "helpfully, accurately and concisely. Images may appear before, between or after the text."
)

SPECIAL_TOKENS: dict[str, list[str]] = {
    "llava": ["<unk>", "<s>", "</s>", "<pad>", "<image>"],
    "qwen2-vl": [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ],
}
"""Special tokens per family; they get the first ids, in this order."""

LLAVA_CHAT_TEMPLATE = (
    "{% set ns = namespace(sys='A chat between a curious user and an artificial intelligence "
    "assistant. The assistant gives helpful, detailed, and polite answers to the user\\'s "
    "questions.') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.sys = message['content'] if message['content'] is string "
    "else message['content'][0]['text'] %}{% endif %}{% endfor %}"
    "{{ bos_token }}{{ ns.sys }}"
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ ' USER: ' if message['role'] == 'user' else ' ASSISTANT: ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}</s>{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)
"""LLaVA-1.5 (Vicuna) conversation format: `<s>{system} USER: <image>\\n{text} ASSISTANT:`.

BOS comes from the template (as Llama-3 templates do), not from the tokenizer, so encoding the
rendered text with or without special tokens gives exactly one BOS (vLLM's chat path encodes
without them)."""

QWEN2VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL ChatML format with `<|vision_start|><|image_pad|><|vision_end|>` per image."""

CHAT_TEMPLATES: dict[str, str] = {"llava": LLAVA_CHAT_TEMPLATE, "qwen2-vl": QWEN2VL_CHAT_TEMPLATE}

# LLaVA-NeXT and Qwen2.5-VL use the tokens of LLaVA and Qwen2-VL; the tiny LLaVA-NeXT keeps the
# LLaVA-1.5 conversation format (a real checkpoint brings its own template).
SPECIAL_TOKENS["llava-next"] = SPECIAL_TOKENS["llava"]
SPECIAL_TOKENS["qwen2.5-vl"] = SPECIAL_TOKENS["qwen2-vl"]
CHAT_TEMPLATES["llava-next"] = LLAVA_CHAT_TEMPLATE
CHAT_TEMPLATES["qwen2.5-vl"] = QWEN2VL_CHAT_TEMPLATE


def _corpus(seed: int, num_words: int) -> Iterator[str]:
    """The training corpus: the passage, then seeded pseudo-words in lines of 16."""
    yield _PASSAGE
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [26 - i for i in range(26)]
    for _ in range(num_words // 16):
        words = ("".join(rng.choices(letters, weights, k=rng.randint(2, 9))) for _ in range(16))
        yield " ".join(words)


def build_tokenizer(family: ModelFamily, vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids and the family's special tokens."""
    specials = SPECIAL_TOKENS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, num_words=max(4 * vocab_size, 2000)), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the BPE trainer reached {tok.get_vocab_size()} ids, not {vocab_size}")
    if family in ("llava", "llava-next"):
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            extra_special_tokens={"image_token": "<image>"},
            chat_template=LLAVA_CHAT_TEMPLATE,
            model_max_length=1 << 20,
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
        },
        chat_template=QWEN2VL_CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
