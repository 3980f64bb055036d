# The fleet's control plane: gateway and scaler (no GPU libraries; the workers
# run from Dockerfile.worker). docker-compose.yml builds it as fleet-gateway.
#
#   docker build -t fleet-gateway .
#   docker run -e REDIS_URL=redis://redis:6379/0 -v ./configs:/app/configs:ro -p 8000:8000 \
#       fleet-gateway fleet gateway --host 0.0.0.0

FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FLEET_CONFIG=/app/configs/fleet.yaml

WORKDIR /app
COPY pyproject.toml README.md ./
COPY fleet ./fleet
COPY fleetctl ./fleetctl
COPY gateway ./gateway
COPY workers ./workers
COPY scaler ./scaler
COPY simulator ./simulator
RUN pip install . && python -c "import fleetctl.cli, gateway.app, scaler.loop; from gateway.dashboard import _page; _page()"

# The config is mounted at run time (configs/ in compose), so one image serves every fleet.
COPY configs ./configs

RUN useradd --create-home --uid 1000 fleet
USER fleet
EXPOSE 8000 9101
CMD ["fleet", "gateway", "--host", "0.0.0.0", "--port", "8000"]
