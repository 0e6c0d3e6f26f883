"""The feature part: attention through the feature map (linear in the sequence length)."""
