"""Engine integrations (each imported only by its engine)."""
