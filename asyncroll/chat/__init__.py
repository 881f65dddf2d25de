"""Chat episodes over the token-level episode API (see asyncroll.chat.episode)."""
