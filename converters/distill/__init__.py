"""`edgespec distill`: build distillation data from a verifier and train a small drafter.

Pipeline (each stage resumable, see the modules):
  prompts.py  built-in / user prompts -> token ids (chat template applied)
  data.py     verifier generates greedy continuations; records top-k log-probs per step
  vocab.py    reduced output vocabulary (most frequent verifier tokens) + id map
  student.py  drafter config + initialisation from the verifier's own weights
  train.py    KL distillation with checkpoints and exact resume
  evaluate.py held-out greedy acceptance at K and draft/verify cost
  card.py     MODEL_CARD.md
"""
