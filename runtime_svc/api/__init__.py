"""gRPC servicers of the runtime service (thin: decode → service layer → encode)."""
