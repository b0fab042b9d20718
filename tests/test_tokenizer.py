"""The tokenizer against transformers' tokenizer read from the same GGUF, and against llama.cpp's
`smollm` pre-tokenizer rules where the two differ (numerals after whitespace; see SMOLLM_ONLY)."""

import json
import random
from pathlib import Path

import jinja2
import pytest
import regex
import tokenizers
import transformers

from jaxserve.checkpoint.tokenizer import IncrementalDetokenizer, Tokenizer

ACCENTS = [
    "Café naïve résumé façade Ångström",
    "Ça va? Où est l'hôtel?",
    "Straße, Müller, Ærø, Œuvre",
    "combining e\u0301 accent",
    "Καλημέρα κόσμε",
]
SCRIPTS = [
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ ー",
    "한국어 텍스트입니다",
    "中文 mixed with English 和数字 123",
    "مرحبا بالعالم",
    "اللغة العربية جميلة.",
    "Россия и Україна",
    "Привет, мир! Как дела?",
    "שלום עולם",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙",
]
EMOJI = [
    "😀",
    "Emoji: 😀👍🏽🇺🇸 and ❤️",
    "👨‍👩‍👧‍👦 family",
    "🏳️‍🌈 flag",
    "🇯🇵🇫🇷🇩🇪",
    "👩🏾‍💻 coding",
    "🤖🚀✨",
    "a😀b",
    " 😀 ",
    "❤️‍🔥 heart on fire",
]
NUMBERS = [
    "1",
    "12",
    "123",
    "1234567890",
    "3.14159",
    "1,000,000",
    "-42",
    "1e-10",
    "0x1F",
    "2024-01-01",
    "12:30:45",
    "$19.99",
    "50%",
    "v1.2.3",
    "a1b2c3",
    "room 101",
    " 2",
    "\n4",
    "1 2 3",
    "x=10,y=20",
]
CODE = [
    "def foo(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "print('hello')",
    '{"key": [1, 2, {"nested": null}]}',
    '<div class="x">&amp;</div>',
    "SELECT * FROM t WHERE id = 7;",
    "x += 1  # comment",
    "fn main() -> Result<(), Box<dyn Error>> {}",
    "    indented\n        more",
    "#include <stdio.h>",
    "a_b-c.d/e\\f",
    "https://example.com/path?q=1&r=2#frag",
    "user@example.com",
]
WHITESPACE = [
    "",
    " ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "a\n\nb",
    "a  \n  b",
    "trailing   ",
    "   leading",
    "tabs\tand\nnewlines\r\nmixed",
    " \t \n ",
    "word\u00a0nbsp",
    "zero\u200bwidth",
    "\u3000ideographic space",
    "a\u2028b",
    "x" * 50 + " " * 20 + "y",
]
SPECIAL = [
    "<|im_start|>",
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|>",
    "text<|im_end|>more",
    "<|im_start|> spaced <|im_end|>",
    "<|im_start",
    "<repo_name>x<file_sep>",
    "< |im_start| >",
]
ENGLISH = [
    "Hello, world!",
    "Hello world",
    " Hello",
    "hello  world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "I'M SURE THEY'LL",
    "'s 't 're",
    "!!!???...",
    "(parens) [brackets] {braces}",
    "«quotes» “curly” ‘single’",
    "…—–",
    "~`^|\\",
    "™®©°±×÷",
    "ﬁ ligature",
    "\x00control\x07",
    "a" * 200,
    (
        "SmolLM2 is a family of compact language models available in three sizes: "
        "135M, 360M, and 1.7B parameters."
    ),
]
# Where llama.cpp's `smollm` pre-tokenizer (like SmolLM2's tokenizer.json: Digits then ByteLevel)
# and transformers' GGUF loader disagree. llama.cpp isolates every \p{N} character before GPT-2's
# regex runs; transformers does not know `smollm` and runs GPT-2's regex alone, which keeps " ²"
# together (its bytes then merge into a piece of "²") and cuts "  3" as " ", " 3" rather than
# "  ", "3". These are checked against llama.cpp's rules instead of transformers.
SMOLLM_ONLY = [
    "  33",
    "1  2\n\n3\t\t4",
    "Steps:\n\n1. Mix\n\n2. Bake",
    "a ²",
    "x² + y² = z²",
    "½ cup",
    " ¼¼",
    "Ⅻ chapter",
    "العربية: ١٢٣",
    "१२३ हिंदी",
    "１２３ fullwidth",
    "①②③",
    "𝟙𝟚𝟛",
]
CORPUS = ACCENTS + SCRIPTS + EMOJI + NUMBERS + CODE + WHITESPACE + SPECIAL + ENGLISH

# llama.cpp's regexes for LLAMA_VOCAB_PRE_TYPE_SMOLLM, applied one after the other.
SMOLLM_SPLITS = (
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about café ☕ and 数字."},
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "  spaces\nand newlines  "},
    ],
]


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def hf_tok(smollm2_gguf: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )


def llama_cpp_pieces(text: str) -> list[str]:
    """Pre-tokens as llama.cpp cuts them: each regex splits every piece, matches and gaps kept."""
    pieces = [text]
    for pattern in SMOLLM_SPLITS:
        cut = []
        for piece in pieces:
            start = 0
            for match in regex.finditer(pattern, piece):
                cut += [piece[start : match.start()], match.group()]
                start = match.end()
            cut.append(piece[start:])
        pieces = [piece for piece in cut if piece]
    return pieces


def test_corpus_is_large() -> None:
    assert len(CORPUS) >= 100


def test_special_token_ids(tok: Tokenizer, hf_tok: transformers.PreTrainedTokenizerBase) -> None:
    assert tok.vocab_size == len(hf_tok) == 49152
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.eos_token_ids == (2,)
    assert (tok.bos_token_id, tok.eos_token_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id)


def test_encode_matches_transformers(
    tok: Tokenizer, hf_tok: transformers.PreTrainedTokenizerBase
) -> None:
    for text in CORPUS:
        for add_special in (True, False):
            expected = hf_tok.encode(text, add_special_tokens=add_special)
            assert tok.encode(text, add_special_tokens=add_special) == expected, text
    assert tok.encode("Hello 123") == [19556, 216, 33, 34, 35]


def test_decode_matches_transformers(
    tok: Tokenizer, hf_tok: transformers.PreTrainedTokenizerBase
) -> None:
    for text in CORPUS:
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
                ids, skip_special_tokens=skip
            ), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode([1, 4093, 198, 26843, 2]) == "user\nHi"


def test_token_text_names_one_token_as_transformers_decodes_it(
    tok: Tokenizer, hf_tok: transformers.PreTrainedTokenizerBase
) -> None:
    """Special tokens, byte tokens of split characters, and again once remembered."""
    ids = [1, 2, 4093, 198, *tok.encode("é 😀 日本")]
    for _ in range(2):
        assert [tok.token_text(i) for i in ids] == [
            hf_tok.decode([i], skip_special_tokens=False) for i in ids
        ]


def test_pre_tokenizer_is_llama_cpp_smollm(
    tok: Tokenizer, hf_tok: transformers.PreTrainedTokenizerBase
) -> None:
    # Reference: llama.cpp's split, then BPE of each piece alone (the pieces need no further split).
    for text in CORPUS + SMOLLM_ONLY:
        if any(special in text for special in ("<|", "<repo_name>")):
            continue
        pieces = llama_cpp_pieces(text)
        expected = [i for p in pieces for i in hf_tok.encode(p, add_special_tokens=False)]
        assert tok.encode(text) == expected, text
    assert tok.encode("a ²") == [81, 216, 19133]  # "a", " ", "²": the numeral stays whole
    assert tok.encode("  33") == [256, 35, 35]  # "  " is one token, as in training


def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: transformers.PreTrainedTokenizerBase
) -> None:
    assert "<|im_start|>" in tok.chat_template
    for messages in CONVERSATIONS:
        for add_prompt in (True, False):
            expected = hf_tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_prompt
            )
            assert tok.apply_chat_template(messages, add_generation_prompt=add_prompt) == expected
    rendered = tok.apply_chat_template(CONVERSATIONS[0])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_helpers_match_transformers(
    tok: Tokenizer, hf_tok: transformers.PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}"
        "{{ raise_exception('no tools') }}"
        "{% endif %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m | tojson }}\n{{ m.content | tojson(indent=2) }}{% generation %}!{% endgeneration %}\n"
        "{% endfor %}{{ strftime_now('%Y') }}{{ eos_token }}"
    )
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": template})
    )
    custom = Tokenizer.from_dir(tmp_path)
    messages = [
        {"role": "user", "content": '<b>café</b> & "quotes"', "name": None},
        {"role": "assistant", "content": "数字 ✓"},
        {"role": "user", "content": "dropped by break"},
    ]
    expected = hf_tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert custom.apply_chat_template(messages) == expected
    assert '"<b>café</b> & \\"quotes\\""' in expected
    with pytest.raises(jinja2.TemplateError, match="no tools"):
        custom.apply_chat_template([{"role": "tool", "content": "x"}])


def test_incremental_detokenizer_holds_split_characters(tok: Tokenizer) -> None:
    texts = SCRIPTS + EMOJI + ["Hi 👋🏽, 你好! Ça va? 🇫🇷", "<|im_end|> 😀 end"]
    split_somewhere = False
    for text in texts:
        ids = tok.encode(text)
        split_somewhere |= any("\ufffd" in tok.decode([i]) for i in ids)
        for prompt_ids in (None, tok.encode("Prompt: é😀")):
            detok = IncrementalDetokenizer(tok, prompt_ids)
            pieces = [detok.add(i) for i in ids]
            assert not any("\ufffd" in piece for piece in pieces), (text, pieces)
            assert "".join(pieces) == detok.text == tok.decode(ids), text
            assert detok.flush() == ""
    assert split_somewhere  # the streams really cut characters between tokens


def test_incremental_detokenizer_piece_boundaries(tok: Tokenizer) -> None:
    ids = tok.encode("😀a")  # 😀 is three tokens: nothing until its last byte arrives
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == ["", "", "😀", "a"]
    skipping = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert [skipping.add(i) for i in tok.encode("x<|im_end|>")] == ["x", "<|im_end|>"]


def test_incremental_detokenizer_flushes_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")[:-1]  # the stream stops inside the emoji
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == "ok "  # the emoji's first bytes are held back
    tail = detok.flush()
    assert tail == "\ufffd"
    assert "".join(pieces) + tail == detok.text == tok.decode(ids)


def test_token_bytes_decode_as_the_tokenizer_does(tok: Tokenizer) -> None:
    keep, skip = tok.token_bytes(skip_special_tokens=False), tok.token_bytes()
    assert keep is not None and skip is not None and len(keep) == tok.vocab_size
    for i, piece in enumerate(keep):
        assert piece.decode("utf-8", "replace") == tok.decode([i], skip_special_tokens=False), i
        assert skip[i].decode("utf-8", "replace") == tok.decode([i]), i
    assert skip[tok.eos_token_id] == b"" and keep[tok.eos_token_id] == b"<|im_end|>"
    # an added token holding a character outside GPT-2's byte map is its own UTF-8
    tiny = Tokenizer.from_gguf_fields(
        tiny_fields(**{"tokenizer.ggml.tokens": ["<s>", "</s>", "<eot>", "a", "b", "ab", "Ġ", "1",
                                                  "<t é>"]})
    )
    assert tiny.token_bytes()[8] == "<t é>".encode() and tiny.decode([8]) == "<t é>"


def test_incremental_detokenizer_streams_any_ids_as_decode_joins_them(tok: Tokenizer) -> None:
    """Random id streams, heavy in tokens that are part of a character (lone UTF-8 lead and
    continuation bytes, which decode turns into U+FFFD) and in special tokens."""
    table = tok.token_bytes(skip_special_tokens=False)
    partial = [i for i, b in enumerate(table) if "\ufffd" in b.decode("utf-8", "replace")]
    special = [tok.eos_token_id, tok.bos_token_id, 0]
    assert len(partial) > 100
    rng = random.Random(0)
    for _ in range(300):
        pools = [rng.choice((partial, special, range(tok.vocab_size), partial)) for _ in range(12)]
        ids = [rng.choice(pool) for pool in pools]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            pieces = [detok.add(i) for i in ids] + [detok.flush()]
            assert "".join(pieces) == detok.text == tok.decode(ids, skip), ids


def test_incremental_detokenizer_keeps_a_sentencepiece_space() -> None:
    """A decoder that strips the first token's leading space (SentencePiece's Metaspace) takes
    the windowed path, seeded with the prompt's last ids."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = tokenizers.decoders.Metaspace()
    sp = Tokenizer(backend)
    assert sp.token_bytes() is None
    assert sp.decode([2, 3]) == "world!"
    seeded = IncrementalDetokenizer(sp, prompt_ids=[1])
    assert [seeded.add(i) for i in (2, 3)] + [seeded.flush()] == [" world", "!", ""]
    assert IncrementalDetokenizer(sp).add(2) == "world"


def test_save_and_from_dir_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    loaded = Tokenizer.from_dir(tmp_path)
    for text in CORPUS + SMOLLM_ONLY:
        ids = tok.encode(text)
        assert loaded.encode(text) == ids, text
        assert loaded.decode(ids) == tok.decode(ids)
    assert (loaded.bos_token_id, loaded.eos_token_ids) == (tok.bos_token_id, tok.eos_token_ids)
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.chat_template == tok.chat_template
    assert loaded.apply_chat_template(CONVERSATIONS[2]) == tok.apply_chat_template(CONVERSATIONS[2])
    # transformers reads the saved directory the same way.
    hf_saved = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_saved.encode("a ² 123 😀<|im_end|>") == tok.encode("a ² 123 😀<|im_end|>")


def test_from_dir_reads_added_token_dicts_and_template_file(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": "<|im_start|>", "__type": "AddedToken"}
    config["add_bos_token"] = True
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.bos_token == "<|im_start|>"
    assert loaded.encode("Hi") == [1, 26843]
    assert loaded.encode("Hi", add_special_tokens=False) == [26843]
    assert loaded.apply_chat_template([{"role": "user", "content": "only"}]) == "only"
    assert loaded.eos_token_ids == (2, 0)


def tiny_fields(**overrides: object) -> dict[str, object]:
    """A byte-level vocabulary small enough to tokenize by hand."""
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": ["<s>", "</s>", "<eot>", "a", "b", "ab", "Ġ", "1", "<think>"],
        "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 1, 1, 1, 4],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.eot_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
    }
    return {**fields, **overrides}


def test_tiny_gguf_vocabulary(tmp_path: Path) -> None:
    tiny = Tokenizer.from_gguf_fields(tiny_fields())
    assert tiny.encode("ab a11<think>") == [0, 5, 6, 3, 7, 7, 8]
    assert tiny.encode("ab", add_special_tokens=False) == [5]
    assert tiny.decode([0, 5, 6, 3, 8, 1]) == "ab a<think>"
    assert tiny.decode([0, 5, 1], skip_special_tokens=False) == "<s>ab</s>"
    assert tiny.eos_token_ids == (1, 2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    tiny.save(tmp_path)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == {"temperature": 0.7, "eos_token_id": [1, 2]}
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.encode("ab a11<think>") == [0, 5, 6, 3, 7, 7, 8]
    assert loaded.eos_token_ids == (1, 2)
    with pytest.raises(ValueError, match="no chat template"):
        loaded.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unsupported_gguf_tokenizers_are_refused() -> None:
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        Tokenizer.from_gguf_fields(tiny_fields(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ValueError, match="pre-tokenizer 'qwen2'"):
        Tokenizer.from_gguf_fields(tiny_fields(**{"tokenizer.ggml.pre": "qwen2"}))
