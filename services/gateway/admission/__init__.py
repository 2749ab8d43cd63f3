"""Overload control at the gateway: SLO-aware admission, fair queues per tenant and priority,
and the goodput they buy (issue 35). See controller.py for the flow."""
