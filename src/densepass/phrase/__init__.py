"""Phrase retrieval (DensePhrases, as trained in training-inference-gap): a phrase encoder gives every passage
token a start and an end vector, a question encoder a start and an end vector per question; a phrase is a
(start, end) token pair up to a maximum length, scored by the sum of the two inner products.

Modules: ``config`` (the ``densepass phrase`` configuration), ``windows`` (passages as token windows with
character offsets), ``model`` (the encoders), ``span_search`` (exact top-k spans under the length constraint),
``index`` (the ``phrase`` index kind), ``batches`` / ``loss`` / ``memory`` / ``train`` (training with
in-passage, in-batch, pre-batch and hard negatives, eq. 1 or eq. 2), ``token_filter`` (the token filter, §5),
``hard_negatives`` (model-based hard negatives, §4.3), ``query_tuning`` (query-side fine-tuning), ``metrics`` and
``validation`` (EM/F1, answer accuracy, passage recall on C0 / R_r / H_k, §3), ``experiment`` (the stages).
"""
