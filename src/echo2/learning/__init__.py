"""Learning plane: tensors, losses, optimizer, checkpoints. Never opens a socket."""
