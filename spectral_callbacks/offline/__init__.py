"""After (or beside) training: event files → tidy rows (events), charts, and models at rest (analysis)."""
