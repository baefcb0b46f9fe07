"""Text <-> token ids, with the checkpoint's own tokenizer and chat template.

Uses the ``tokenizers`` library on the checkpoint's tokenizer.json and renders
the chat template with jinja2 the way Hugging Face does (sandboxed, trimmed
blocks), so prompts are byte-identical to what the model was trained on.
"""

import json
import re
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

from libs.protocol.errors import InvalidRequestError, ModelNotFoundError

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], eos_token_ids: list[int]) -> None:
        self._tok = tokenizer
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_ids = list(eos_token_ids)
        self._template: jinja2.Template | None = None
        self._byte_of: dict[str, int] | None = None  # byte-level BPE's alphabet, read back to bytes
        if isinstance(tokenizer.decoder, ByteLevel):
            self._byte_of = {char: byte for byte, char in enumerate(byte_level_alphabet())}
        # SentencePiece BPE (spaces as U+2581, <0xXX> pieces for bytes): read back piece by piece
        self._sentencepiece = getattr(tokenizer.model, "byte_fallback", False)
        self._special = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}

    @classmethod
    def from_dir(cls, path: Path, eos_token_ids: list[int]) -> "Tokenizer":
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise ModelNotFoundError(f"{path} has no tokenizer.json")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_file = path / "chat_template.jinja"
        if "chat_template" not in config and template_file.exists():
            config["chat_template"] = template_file.read_text()
        return cls(HFTokenizer.from_file(str(tok_file)), config, eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """The added tokens: control tokens such as end-of-turn, never text a grammar could match."""
        return frozenset(self._special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (part of a UTF-8 character, for some): a
        byte-level BPE token read back through its alphabet, a SentencePiece piece with
        its U+2581 as a space (a <0xXX> piece: that byte); an added token's text, or any
        other tokenizer's decode of the token alone, as UTF-8."""
        if token_id in self._special:
            return self._special[token_id].encode()
        piece = self._tok.id_to_token(token_id)
        if self._byte_of is not None and piece is not None and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        if self._sentencepiece and piece is not None:
            if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
                return bytes([int(byte.group(1), 16)])
            return piece.replace("\u2581", " ").encode()
        return self._tok.decode([token_id], skip_special_tokens=False).encode()

    def decode_stream(self, skip_special_tokens: bool = True) -> "TokenTextStream":
        return TokenTextStream(self._tok, skip_special_tokens)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list (Hugging Face's convention)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use the completions API")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Render the chat template and tokenize it; special tokens come from the template."""
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


class TokenTextStream:
    """Incremental detokenization: feed ids one at a time, get text once it is whole UTF-8."""

    def __init__(self, tokenizer: HFTokenizer, skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte 0..255
    (printable bytes for themselves, the rest shifted past U+00FF)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return [chars[byte] for byte in range(256)]


def _token_text(token: str | dict | None) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)
