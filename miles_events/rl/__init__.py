"""Pure RL helpers, with no bus: weight versions, checksums, prompts, rewards, Hugging Face
model building and the checkpoint format."""
