"""Fine-tuning data and metrics for the paper's Table 5 tasks, read from the files users download.

| module | one idea |
| --- | --- |
| `files.py` | `TaskDataError` and the file checks every reader shares |
| `encoding.py` | the WordPiece tokenizer behind a task, `[CLS] A [SEP] B [SEP]` rows (`PackedPairs`), `EncodedTask` |
| `glue.py` | MNLI and QQP TSV readers, pair classification rows |
| `race.py` | RACE per-article JSON reader, 4-way multiple-choice rows |
| `squad.py` | SQuAD 1.1 / 2.0 JSON reader, document-stride windows with answer positions and offsets |
| `squad_decode.py` | best span over all windows of a question, and its no-answer (null) score |
| `squad_metrics.py` | SQuAD EM / F1 and the no-answer threshold, by the official definitions |
| `metrics.py` | accuracy, positive-class F1, RACE accuracy per level |
| `batches.py` | `TrainBatches` (the loader protocol, shuffled per epoch) and `OrderedBatches` (evaluation) |
"""
