"""Text ↔ token ids, chat templates and streaming detokenization.

One `Tokenizer` wraps a `tokenizers.Tokenizer` (the Hugging Face Rust library), built either from
a Hugging Face directory (tokenizer.json + tokenizer_config.json) or from a GGUF file's metadata.
A GGUF carries no tokenizer.json: only the vocabulary, the merges, token types and the name of the
pre-tokenizer llama.cpp applies, so `from_gguf_fields` rebuilds the pipeline those names stand for.
`save` writes the Hugging Face layout, so a converted checkpoint needs nothing from the GGUF later.
"""

import codecs
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, pre_tokenizers, processors

from jaxserve.checkpoint.gguf_file import read_gguf

# llama.cpp's token types (gguf.TokenType): control tokens are the special ones (`<|im_end|>`),
# user-defined ones are added tokens matched whole in text but kept when decoding (`<think>`).
_CONTROL = 3
_USER_DEFINED = 4

# llama.cpp pre-tokenizer names (`tokenizer.ggml.pre`) grouped by the split they apply before BPE.
# GPT-2's regex is what ByteLevel(use_regex=True) applies. The second group runs `\p{N}` first
# (each digit alone) and then GPT-2's regex, which is exactly Digits(individual_digits) followed
# by ByteLevel: the pipeline in the tokenizer.json of StarCoder and SmolLM.
_GPT2_REGEX_PRE = frozenset({"gpt2", "mpt", "olmo", "jais"})
_DIGITS_THEN_GPT2_REGEX_PRE = frozenset(
    {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"}
)

# The GGUF metadata `from_gguf` reads; the rest of the file (weights, model shape) is not needed.
_GGUF_TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.chat_template",
)


class Tokenizer:
    """A byte-level or Hugging Face tokenizer with its special tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        """`backend` must already add BOS/EOS on `encode` as the two flags say; the flags are
        kept so that `save` can record them. `stop_token_ids` are ids besides EOS that end a
        generation (GGUF's end-of-turn token, generation_config.json's list).
        """
        self._backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._add_bos_token = add_bos_token
        self._add_eos_token = add_eos_token
        self._chat_template = chat_template
        self._stop_token_ids = tuple(stop_token_ids)
        self._compiled_template: jinja2.Template | None = None
        self._token_texts: dict[int, str] = {}
        self._token_bytes: dict[bool, list[bytes] | None] = {}
        self._whole_texts: dict[bool, list[str | None] | None] = {}

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json and, where present, chat_template.jinja
        (newer transformers saves the template there) and generation_config.json (more stop ids).
        """
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        add_bos = bool(config.get("add_bos_token", False))
        add_eos = bool(config.get("add_eos_token", False))
        # As transformers does: explicit flags (or no post-processor at all) replace the
        # post-processor of tokenizer.json; otherwise that post-processor is the truth.
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            backend.post_processor = _bos_eos_processor(
                backend, bos_token, eos_token, add_bos, add_eos
            )
        template_file = path / "chat_template.jinja"
        chat_template = (
            template_file.read_text() if template_file.exists() else _template_text(config)
        )
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id", [])
        stop_ids = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos)
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=chat_template,
            stop_token_ids=stop_ids,
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """Read the tokenizer metadata of a GGUF file."""
        fields = read_gguf(path).fields
        return cls.from_gguf_fields({k: fields[k] for k in _GGUF_TOKENIZER_KEYS if k in fields})

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata given as plain Python values, keyed by GGUF name.

        Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported, with the pre-tokenizers
        listed at the top of this module; anything else raises ValueError rather than tokenizing
        text differently from the model's training.
        """
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {model!r} is not supported: only byte-level BPE ('gpt2') is"
            )
        tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
        token_types = list(fields.get("tokenizer.ggml.token_type") or [])
        merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]
        backend = tokenizers.Tokenizer(
            tokenizers.models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges)
        )
        backend.pre_tokenizer = _gguf_pre_tokenizer(fields.get("tokenizer.ggml.pre", "gpt2"))
        backend.decoder = decoders.ByteLevel()
        typed = list(zip(tokens, token_types))
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, kind in typed if kind == _CONTROL]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, kind in typed
                if kind == _USER_DEFINED
            ]
        )

        def token(key: str) -> str | None:
            token_id = fields.get(key)
            return None if token_id is None else tokens[token_id]

        bos_token, eos_token = (
            token("tokenizer.ggml.bos_token_id"),
            token("tokenizer.ggml.eos_token_id"),
        )
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _bos_eos_processor(backend, bos_token, eos_token, add_bos, add_eos)
        stop_ids = [
            fields[key]
            for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if key in fields
        ]
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=fields.get("tokenizer.chat_template"),
            stop_token_ids=stop_ids,
        )

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (and generation_config.json when there
        are stop ids besides EOS) so that `from_dir(path)` behaves the same, and transformers'
        AutoTokenizer can load the directory too.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "add_bos_token": self._add_bos_token,
            "add_eos_token": self._add_eos_token,
            "chat_template": self._chat_template,
        }
        (path / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False)
        )
        if self._stop_token_ids:
            # Merge: a converted checkpoint keeps its sampling defaults in the same file.
            generation_file = path / "generation_config.json"
            generation = {**_read_json(generation_file), "eos_token_id": list(self.eos_token_ids)}
            generation_file.write_text(json.dumps(generation, indent=2))

    # ---- text ↔ ids ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`) become their
        ids, as in transformers. `add_special_tokens` adds BOS/EOS where the model wants them.

        Through `encode_batch`, which lets go of the GIL while it tokenizes (`encode` holds
        it: ~50 ms for a 100 kB prompt, in which no other Python thread ran, the server's
        event loop and engine included); the ids are the same.
        """
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not complete a UTF-8 character decode to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included: how logprobs name tokens.

        Remembered once decoded: a stream with 20 alternatives a token names 20 tokens
        a step, and a decode costs ~20 us of the event loop.
        """
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each id's bytes as `decode` joins them (b"" for a skipped special token), where the
        decoder is byte-level (GPT-2, Llama 3, Qwen, SmolLM); None for any other decoder.

        `decode(ids)` is then these bytes concatenated and decoded with U+FFFD for bad UTF-8,
        which lets a stream decode each new id's bytes alone (`IncrementalDetokenizer`).
        Built once a flag (~50 ms for 49k ids), from the ByteLevel decoder's own rule: a token
        whose characters all stand for bytes is those bytes, any other (an added token
        holding a space) is its own UTF-8.
        """
        if skip_special_tokens not in self._token_bytes:
            table = None
            if isinstance(self._backend.decoder, decoders.ByteLevel):
                byte_of = _byte_level_bytes()
                table = [b""] * self.vocab_size
                for token, token_id in self._backend.get_vocab(with_added_tokens=True).items():
                    try:
                        table[token_id] = bytes(byte_of[c] for c in token)
                    except KeyError:
                        table[token_id] = token.encode()
                if skip_special_tokens:
                    for token_id, added in self._backend.get_added_tokens_decoder().items():
                        if added.special:
                            table[token_id] = b""
            self._token_bytes[skip_special_tokens] = table
        return self._token_bytes[skip_special_tokens]

    def whole_texts(self, skip_special_tokens: bool = True) -> list[str | None] | None:
        """`token_bytes` decoded, where an id's bytes are whole UTF-8 characters (None where
        they hold part of one): a stream's common case, without the incremental decoder."""
        if skip_special_tokens not in self._whole_texts:
            table = self.token_bytes(skip_special_tokens)
            if table is not None:
                table = [_whole_text(b) for b in table]
            self._whole_texts[skip_special_tokens] = table
        return self._whole_texts[skip_special_tokens]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def bos_token_id(self) -> int | None:
        return None if self._bos_token is None else self._backend.token_to_id(self._bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self._eos_token is None else self._backend.token_to_id(self._eos_token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: EOS first, then the other stop ids, without repeats."""
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        return tuple(dict.fromkeys(eos + self._stop_token_ids))

    # ---- chat ---------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages` (`[{"role": ..., "content": ...}]`), rendered as
        transformers' `apply_chat_template(..., tokenize=False)` renders it.
        """
        if self._chat_template is None:
            raise ValueError(
                "this model has no chat template; send a plain completion prompt instead"
            )
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self._chat_template)
        # OpenAI clients send `content: None` beside tool calls; templates expect the key absent.
        plain = [{k: v for k, v in message.items() if v is not None} for message in messages]
        return self._compiled_template.render(
            messages=plain,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token,
            eos_token=self._eos_token,
        )


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text pieces that never split a UTF-8 character.

    A byte-level token may hold part of a character (an emoji is four bytes, often three tokens),
    so decoding one id at a time would emit U+FFFD. Where the tokenizer is byte-level, each id's
    bytes go through an incremental UTF-8 decoder, which holds an unfinished character's bytes
    until the rest arrive: one table lookup a token, not a tokenizer call.

    Any other decoder (SentencePiece's, which strips a leading space) takes vLLM's
    `detokenize_incrementally` instead: a short window of ids is decoded twice, up to the read
    offset (text already emitted) and to the end; the difference is new text, unless it ends in
    U+FFFD, which waits for the bytes that complete it. Each emission slides the window to start
    at the old read offset, and the prompt's last ids seed it so that the first generated
    token keeps its space.

    The pieces from `add`, then `flush`, concatenate to `tokenizer.decode(generated ids)` for
    byte-level tokenizers.
    """

    # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt ids kept as decoding context.
    _PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_bytes = tokenizer.token_bytes(skip_special_tokens)
        self._whole_texts = tokenizer.whole_texts(skip_special_tokens)
        self._holding = False  # the UTF-8 decoder holds part of a character
        # bad bytes become U+FFFD, as in Rust's from_utf8_lossy that `decode` applies
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # the window (other decoders only)
        context = () if self._token_bytes is not None else prompt_ids or ()
        self._window_ids = list(context[-self._PROMPT_CONTEXT :])
        self._read_offset = len(self._window_ids)  # window ids before this are emitted
        self._pieces: list[str] = []  # not one growing str, which each append would copy

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """Append one generated id; returns the text it completes (often "", never a split char)."""
        if self._token_bytes is not None:
            text = self._whole_texts[token_id]
            if text is None or self._holding:  # a character's part, or the rest of one
                text = self._utf8.decode(self._token_bytes[token_id])
                self._holding = bool(self._utf8.getstate()[0])
            return self._emit(text)
        self._window_ids.append(token_id)
        return self._advance(hold_incomplete=True)

    def flush(self) -> str:
        """At the end of a stream: emit what is held back (bytes that never made a character)."""
        if self._token_bytes is not None:
            return self._emit(self._utf8.decode(b"", final=True))
        return self._advance(hold_incomplete=False)

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text

    def _advance(self, hold_incomplete: bool) -> str:
        emitted = self._decode(self._window_ids[: self._read_offset])
        window = self._decode(self._window_ids)
        if hold_incomplete and window.endswith("\ufffd"):
            return ""
        # Both decodes end on whole characters, so the window's text extends the emitted text.
        new_text = window[len(emitted) :]
        del self._window_ids[: self._read_offset]
        self._read_offset = len(self._window_ids)
        return self._emit(new_text)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


# ---- helpers ------------------------------------------------------------------------------


def _whole_text(data: bytes) -> str | None:
    """`data` as text if it is whole UTF-8 characters, else None."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def _gguf_pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """The Hugging Face pre-tokenizer equal to llama.cpp's pre-tokenizer `name`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _GPT2_REGEX_PRE:
        return byte_level
    if name in _DIGITS_THEN_GPT2_REGEX_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    supported = sorted(_GPT2_REGEX_PRE | _DIGITS_THEN_GPT2_REGEX_PRE)
    raise ValueError(f"GGUF pre-tokenizer {name!r} is not supported; supported: {supported}")


def _byte_level_bytes() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for (GPT-2's map):
    printable Latin-1 bytes stand for themselves, the rest for characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    byte_of = {chr(b): b for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in printable):
        byte_of[chr(256 + n)] = b
    return byte_of


def _bos_eos_processor(
    backend: tokenizers.Tokenizer,
    bos_token: str | None,
    eos_token: str | None,
    add_bos: bool,
    add_eos: bool,
) -> processors.TemplateProcessing:
    """A post-processor that adds BOS before and EOS after a sequence, as the flags say."""
    pieces, special = ["$A"], []
    if add_bos and bos_token is not None:
        pieces.insert(0, bos_token)
        special.append((bos_token, backend.token_to_id(bos_token)))
    if add_eos and eos_token is not None:
        pieces.append(eos_token)
        special.append((eos_token, backend.token_to_id(eos_token)))
    return processors.TemplateProcessing(single=" ".join(pieces), special_tokens=special)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    return token["content"] if isinstance(token, Mapping) else token


def _template_text(config: Mapping[str, Any]) -> str | None:
    """The chat template of tokenizer_config.json: a string, or named templates (use "default")."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks in
    transformers; rendering a prompt only needs the body.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _compile_chat_template(template: str) -> jinja2.Template:
    """Compile as transformers does: sandboxed (templates come from model files), trimmed blocks,
    and the same globals and `tojson` (no HTML escaping, non-ASCII kept).
    """

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
