"""Training the drafter heads (docs/training.md): self-distillation data (data), the one
training loop (loop), and its two users, the EAGLE trainer (eagle) and the Medusa trainer
(medusa)."""
