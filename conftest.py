# Makes the repository root importable (config/, recam/, rewards/) for tests run from any folder.
