"""The exact band: softmax over the local window and the attention sinks."""
