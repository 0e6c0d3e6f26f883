"""The Hugging Face Hub: Hub-ready export with bundled remote code (:mod:`.export`) and its model
card (:mod:`.model_card`)."""
