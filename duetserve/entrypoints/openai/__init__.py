"""OpenAI-compatible HTTP server: protocol (request models), serving (the two generation
endpoints), api_server (the FastAPI app), serve (`duet serve`)."""
