"""Pure RL, with no bus and no devices: weight versions, checksums and their manifests,
publication checks, the canary and the probe, prompts, rewards, the Hugging Face model
(built-in or a directory), and the rollout-only evidence."""
