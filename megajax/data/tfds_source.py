"""A TFDS text dataset as a training corpus (optional extra ``tfds``; TensorFlow itself is not needed).

``--config.data.source=tfds --config.data.tfds_name=NAME --config.data.tokenizer=TOKENIZER`` streams the text
feature of an array_record TFDS dataset through ``tfds.data_source`` (random access, no tf.data) into the same
tokenization and indexed format as ``megajax.data.preprocess``, cached per dataset, split, feature and tokenizer.
"""

from __future__ import annotations

import hashlib
import pathlib
import sys
from collections.abc import Iterator

from megajax.data.indexed import META, IndexedTokens
from megajax.data.preprocess import write_documents
from megajax.data.tokenizer import load_tokenizer


def _tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("data.source=tfds needs the optional extra: pip install 'megajax[tfds]'") from e
    return tfds


def tfds_documents(name: str, split: str, feature: str, data_dir: str | None = None) -> Iterator[str]:
    """The texts of ``feature`` in a prepared TFDS dataset, in record order."""
    source = _tfds().data_source(name, split=split, data_dir=data_dir or None)
    for example in source:
        if feature not in example:
            raise KeyError(f"TFDS dataset {name} has no feature {feature!r}; it has {sorted(example)}; set "
                           "--config.data.tfds_feature")
        text = example[feature]
        yield text.decode("utf-8") if isinstance(text, bytes) else str(text)


def tfds_corpus(name: str, split: str, feature: str, tokenizer_path: str, cache_dir: pathlib.Path,
                data_dir: str | None = None, min_tokens: int = 0) -> IndexedTokens:
    """Tokenizes the dataset once into ``cache_dir`` and returns it memory-mapped."""
    if not tokenizer_path:
        raise ValueError("data.source=tfds needs --config.data.tokenizer=PATH (tokenizer.json, a GPT-2 BPE "
                         "directory or a vocab.txt)")
    tokenizer_bytes = pathlib.Path(tokenizer_path).read_bytes() if pathlib.Path(tokenizer_path).is_file() else \
        tokenizer_path.encode()
    tag = hashlib.sha1(b"|".join([name.encode(), split.encode(), feature.encode(), tokenizer_bytes,
                                  str(min_tokens).encode()])).hexdigest()[:12]
    prefix = cache_dir / "tfds" / f"{name.replace('/', '_')}-{split}-{tag}" / "corpus"
    if not pathlib.Path(f"{prefix}{META}").is_file():
        print(f"tokenizing TFDS {name}[{split}].{feature} once into {prefix.parent}", file=sys.stderr)
        write_documents(tfds_documents(name, split, feature, data_dir), load_tokenizer(tokenizer_path), prefix,
                        meta={"source": f"tfds:{name}/{split}/{feature}"}, min_tokens=min_tokens,
                        progress=sys.stderr.isatty())
    return IndexedTokens.open(prefix)
