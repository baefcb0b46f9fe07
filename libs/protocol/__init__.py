"""The wire protocol every service speaks: message types (schema), the vocabulary of
names and codes, typed ids, NATS subjects, block hashing, sampling parameters, the
errors a request can meet, and the names models are served under. Importable without
torch, and imports nothing else of the project."""
