"""Modal screens: confirmation (y / n / esc), the pin form, and the doctor report."""
