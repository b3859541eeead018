/** An operation as the ledger answered it: every field of the API's operation as a property
 * (operation_id, state, version, idempotency_key, result, ...); `.data` is the whole answer. */
export class Receipt {
  constructor(data) {
    Object.assign(this, data);
    Object.defineProperty(this, "data", { value: data, enumerable: false });
  }

  toString() {
    return `<Receipt ${this.data.operation_id} ${this.data.operation} ${this.data.state} v${this.data.version}>`;
  }
}
