"""The console's views (one Textual mode each) and the help screen."""
