"""Audio in: 16 kHz mono PCM s16le -> log-mel features -> audio tokens per generator step."""
