"""The fine-tuning tasks' data (the paper's Table 5), read from the files users download; their metrics are
evaluation's (``megajax.evaluation.task_metrics``, ``squad_decode``, ``squad_metrics``).

| module | one idea |
| --- | --- |
| `files.py` | `TaskDataError` and the file checks every reader shares |
| `encoding.py` | the WordPiece tokenizer behind a task, `[CLS] A [SEP] B [SEP]` rows (`PackedPairs`), `EncodedTask` |
| `glue.py` | MNLI and QQP TSV readers, pair classification rows |
| `race.py` | RACE per-article JSON reader, 4-way multiple-choice rows |
| `squad.py` | SQuAD 1.1 / 2.0 JSON reader, document-stride windows with answer positions and offsets |
| `batches.py` | `TrainBatches` (the loader protocol, shuffled per epoch) |
| `task_data.py` | `data.source=task`: a task's train and validation rows, read from its files or generated |
"""
