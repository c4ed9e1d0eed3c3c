# The web inspector's browser test (tests/integration/test_web_ui_browser.py) drives
# Debian's chromium through Debian's chromedriver with selenium; nothing downloads a
# browser build of its own. Installed with apt-get when missing, so `make test` on a
# fresh machine needs nothing by hand.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: browser
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		echo "installing chromium and chromium-driver (Debian packages)"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
			chromium chromium-driver >/dev/null; \
	fi

TEST_PREREQS += browser
