"""The causal hybrid (exact band + feature scan) in training as one recomputing Function."""
