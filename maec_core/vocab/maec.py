"""MAEC over a language base whose tokenizer extends the donor's (placeholder)."""
