"""A tokenizer folder as transformers writes and reads it: its chat template, found where transformers looks for it
and compiled as transformers compiles it (so a chat row renders as ``apply_chat_template`` renders it), its special
tokens, and a run's tokenizer written as such a folder beside exported weights (``write_folder``).

Where (the first that holds one; transformers' order): ``chat_template.jinja`` (transformers 5 writes a single
template there) with any named ones in ``additional_chat_templates/NAME.jinja`` (the ``default`` one is used);
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name", "template"}``); a processor's
``chat_template.json`` or ``processor_config.json`` key ``chat_template``. Without one, ``DEFAULT_TEMPLATE``, said
as such in the run's start record. The special tokens' texts a template reads (``bos_token``, ...) come from
``tokenizer_config.json``, then ``special_tokens_map.json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import shutil

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megajax.data.tokenizer import load_tokenizer
from megajax.errors import ConfigError
from megajax.outputs import HF_TEMPLATE_DIR, HF_TOKENIZER_FILES

# A documented default for tokenizers without a chat template: one "role: content" line per message, and
# "assistant: " as the generation prompt.
DEFAULT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant: {% endif %}")
DEFAULT_SOURCE = "megajax's default ('role: content' lines): no chat template beside the tokenizer"

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = HF_TEMPLATE_DIR
# the files of a tokenizer folder a chat template or the special tokens' texts are read from (an export copies them)
CONFIG_FILES = tuple(name for name in HF_TOKENIZER_FILES if name != "tokenizer.json")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template's jinja text, where it came from, and the special tokens' texts it may read."""

    text: str
    source: str  # the file (and entry) it was read from, or DEFAULT_SOURCE
    specials: dict[str, str]

    def compiled(self) -> jinja2.Template:
        """The template compiled in transformers' environment; ConfigError naming the file and line of a syntax
        error."""
        try:
            return _environment().from_string(self.text)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"the chat template in {self.source} does not compile: line {e.lineno}: {e.message}; "
                              "fix the template") from None


def folder_of(tokenizer_path: str | pathlib.Path) -> pathlib.Path:
    """The folder of a tokenizer given as a folder or as one of its files."""
    p = pathlib.Path(tokenizer_path)
    return p if p.is_dir() else p.parent


def _json(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({e}); fix or remove it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds no JSON object; fix or remove it")
    return data


def _pick(templates: dict[str, str], where: str) -> tuple[str, str]:
    """The default of several named templates (transformers' rule: the one named ``default``)."""
    if "default" not in templates:
        raise ConfigError(f"{where} holds chat templates named {sorted(templates)} and none named 'default'; name "
                          "the one to train with 'default' (or write it to chat_template.jinja)")
    return templates["default"], "" if len(templates) == 1 else " (its 'default' template)"


def _found(folder: pathlib.Path) -> tuple[str, str] | None:
    """(text, source) of the folder's chat template, in transformers' order; None where there is none."""
    named = {p.stem: p for p in sorted((folder / TEMPLATE_DIR).glob("*.jinja"))}
    if (folder / TEMPLATE_FILE).is_file() or named:
        files = {**({"default": folder / TEMPLATE_FILE} if (folder / TEMPLATE_FILE).is_file() else {}), **named}
        chosen, _ = _pick({k: str(p) for k, p in files.items()}, str(folder))
        try:
            return pathlib.Path(chosen).read_text(encoding="utf-8"), chosen
        except UnicodeDecodeError as e:
            raise ConfigError(f"{chosen} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    for name in ("tokenizer_config.json", "chat_template.json", "processor_config.json"):
        if not (folder / name).is_file():
            continue
        template = _json(folder / name).get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            try:
                template = {t["name"]: t["template"] for t in template}
            except (TypeError, KeyError):
                raise ConfigError(f"{folder / name}: 'chat_template' is a list of entries other than "
                                  "{'name', 'template'}; fix it") from None
            text, which = _pick(template, str(folder / name))
            return text, f"{folder / name}{which}"
        if isinstance(template, str):
            return template, f"{folder / name} ('chat_template')"
        if template is not None:
            raise ConfigError(f"{folder / name}: 'chat_template' is neither a template nor a list of them; fix it")
    return None


def _specials(folder: pathlib.Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second's entries win
        if (folder / name).is_file():
            out.update({k: (v["content"] if isinstance(v, dict) else v) for k, v in _json(folder / name).items()
                        if k.endswith("_token") and (isinstance(v, str) or isinstance(v, dict) and "content" in v)})
    return out


def read_chat_template(tokenizer_path: str | pathlib.Path) -> ChatTemplate:
    """The chat template of the tokenizer folder ``tokenizer_path`` is (or is a file of), else the default; with
    the special tokens' texts. ConfigError naming a file that cannot be read."""
    folder = folder_of(tokenizer_path)
    found = _found(folder)
    text, source = found if found else (DEFAULT_TEMPLATE, DEFAULT_SOURCE)
    return ChatTemplate(text, source, _specials(folder))


def _environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment transformers renders chat templates in (sandboxed, blocks trimmed, loop controls,
    ``raise_exception``, ``strftime_now``, a ``tojson`` that leaves non-ASCII as it is)."""
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f))
    return env


def write_folder(tokenizer_path: str | pathlib.Path, out: pathlib.Path) -> dict[str, int]:
    """Writes the tokenizer at ``tokenizer_path`` into ``out`` so that ``AutoTokenizer.from_pretrained(out)`` reads
    it: its ``tokenizer.json`` (copied, or written by the tokenizers library from vocab.json + merges.txt or
    vocab.txt), its folder's ``CONFIG_FILES`` and named chat templates copied, else a ``tokenizer_config.json``
    naming its end-of-document token as the end (and beginning) of sequence. Returns the ``bos_token_id`` and
    ``eos_token_id`` a model's ``config.json`` holds. ValueError where the tokenizer cannot be read."""
    tok = load_tokenizer(tokenizer_path)
    source, folder = pathlib.Path(tok.source), folder_of(tokenizer_path)
    if source.name == "tokenizer.json":
        shutil.copyfile(source, out / "tokenizer.json")
    else:
        tok.save(out / "tokenizer.json")
    for name in CONFIG_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    if (folder / TEMPLATE_DIR).is_dir():
        shutil.copytree(folder / TEMPLATE_DIR, out / TEMPLATE_DIR)
    end = tok.tokenizer.id_to_token(tok.eod_id)
    if not (out / "tokenizer_config.json").is_file():
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": end, "eos_token": end}, indent=2) + "\n")
    specials = _specials(out)
    ids = {k: tok.tokenizer.token_to_id(specials.get(k.removesuffix("_id"), end)) for k in ("bos_token_id",
                                                                                            "eos_token_id")}
    return {k: tok.eod_id if v is None else v for k, v in ids.items()}
