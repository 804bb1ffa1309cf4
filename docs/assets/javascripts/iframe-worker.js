/* A Web Worker stand-in for pages opened from file://, where the browser refuses to start a
 * worker (the search index is built in one). The worker's script runs in a hidden same-origin
 * iframe instead: its `addEventListener("message")` hears what the page posts, its `postMessage`
 * reaches the page. Material's offline plugin expects such a shim among `extra.polyfills`; this
 * one ships with the site, so nothing is fetched from the network. Over HTTP it does nothing. */
(function () {
  "use strict";
  if (location.protocol !== "file:" || typeof EventTarget === "undefined") return;

  class IframeWorker extends EventTarget {
    constructor(url) {
      super();
      this.pending = [];
      this.ready = false;
      const frame = document.createElement("iframe");
      frame.setAttribute("aria-hidden", "true");
      frame.setAttribute("tabindex", "-1");
      frame.style.display = "none";
      (document.body || document.documentElement).appendChild(frame);
      const win = frame.contentWindow;
      this.win = win;
      win.postMessage = (data) => {
        setTimeout(() => this.dispatchEvent(new MessageEvent("message", { data: data })), 0);
      };
      win.importScripts = () => {
        throw new Error("importScripts is not available to a worker opened from file://");
      };
      const script = win.document.createElement("script");
      script.src = new URL(String(url), location.href).href;
      script.onload = () => {
        this.ready = true;
        this.pending.splice(0).forEach((data) => this.deliver(data));
      };
      script.onerror = () => this.dispatchEvent(new Event("error"));
      win.document.head.appendChild(script);
    }

    deliver(data) {
      const win = this.win;
      setTimeout(() => win.dispatchEvent(new win.MessageEvent("message", { data: data })), 0);
    }

    postMessage(data) {
      if (this.ready) this.deliver(data);
      else this.pending.push(data);
    }

    terminate() {}
  }

  window.Worker = IframeWorker;
})();
