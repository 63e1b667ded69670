"""The fast tier: no server, no PostgreSQL, no subprocess worth waiting for (`pytest tests/unit`)."""
