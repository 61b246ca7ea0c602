"""Record -> sample transforms (tokenization)."""
