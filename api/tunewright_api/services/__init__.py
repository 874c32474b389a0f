"""Services: keyword-only functions that own a request's transaction. Routes parse and shape; services
decide and commit; backends do what depends on where jobs run."""
