"""Test doubles: fakes of the store and the clock. Production code never imports these."""
