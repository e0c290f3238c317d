"""The job record (the single source of truth for a job) and its Redis stores."""
