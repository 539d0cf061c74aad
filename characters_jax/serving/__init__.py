"""The generator worker process (`characters-jax serve`): CharacterService, its health,
admission, authentication and metrics, the live session and its step loop, the session table,
placement, and the supervised decoder process."""
